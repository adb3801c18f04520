// rope_rows: rotate-half rotary embedding of rows [c0*rows_per, min(c0*rows_per + rows_per,
// rows)) of x[rows, D] (blockops/rope.py). Row r sits at position pos_ids[(r / group) *
// pos_s0] when pos_ids is given, else at `pos`. angle = float(position) * inv_freq[j]
// (f32), accurate sincosf, and the products and sums rounded one by one (no FMA
// contraction) as torch evaluates x1*cos - x2*sin and x2*cos + x1*sin (rope_rotate: HF
// rounds as Hugging Face's apply_rotary_pos_emb does).
// NORM: each row is first RMS-normalised as the rms_norm kind does (rownorm.cuh),
// x <- T(T(x * rinv) * g). A warp per row, lanes over the D/2 rotation pairs; out may be
// a KV cache row (RoPE + KV append), and in place (out == x) is safe.
#pragma once
#include "common.cuh"

// One row by a warp, lanes over the D/2 rotation pairs: rope_load reads x (elements xs apart) into
// the lane's pairs, rope_store normalises (NORM), rotates at position p and writes out (elements os apart).
template <int D> __host__ __device__ constexpr int rope_pairs() { return cdiv(D / 2, 32); }  // rotation pairs per lane

template <class T, int D>
__device__ __forceinline__ void rope_load(const T* x, long long xs, float (&x1)[rope_pairs<D>()],
                                          float (&x2)[rope_pairs<D>()]) {
    static_assert(D % 2 == 0, "rope: head dim must be even");
    constexpr int H = D / 2;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < rope_pairs<D>(); ++t) {
        const int j = t * 32 + lane;
        x1[t] = j < H ? ld_f32(x + j * xs) : 0.0f;
        x2[t] = j < H ? ld_f32(x + (j + H) * xs) : 0.0f;
    }
}

// What a lane's rotation pairs need of a head, the same for all its rows (a caller storing several loads
// it once: each load is an L2 round trip): the frequencies and (NORM) the gains of both halves.
template <int D> struct RopeLane {
    float freq[rope_pairs<D>()], g1[rope_pairs<D>()], g2[rope_pairs<D>()];
};
template <class T, int D, bool NORM>
__device__ __forceinline__ RopeLane<D> rope_lane(const float* inv_freq, Vec<const T> g) {
    constexpr int H = D / 2;
    const int lane = threadIdx.x & 31;
    RopeLane<D> c;
#pragma unroll
    for (int t = 0; t < rope_pairs<D>(); ++t) {
        const int j = t * 32 + lane;
        c.freq[t] = j < H ? ld_cg(inv_freq + j) : 0.0f;
        c.g1[t] = NORM && j < H ? ld_f32(g.p + j * g.s0) : 0.0f;
        c.g2[t] = NORM && j < H ? ld_f32(g.p + (j + H) * g.s0) : 0.0f;
    }
    return c;
}

// (sin, cos) of x, accurate (torch's); OUTLINE: out of line, so a caller rotating several rows in an
// unrolled loop (kv_store_rope) holds one copy of sincosf's code, not one a row: cold code is fetched at
// L2 speed (a 64-row kv_store_rope instance: 13.8 -> 9.5 us, perf-notes #89).
__device__ __noinline__ float2 rope_sincos_call(float x) {
    float sn, cs;
    sincosf(x, &sn, &cs);
    return make_float2(sn, cs);
}
template <bool OUTLINE> __device__ __forceinline__ float2 rope_sincos(float x) {
    if constexpr (OUTLINE) {
        return rope_sincos_call(x);
    } else {
        float sn, cs;
        sincosf(x, &sn, &cs);
        return make_float2(sn, cs);
    }
}

// The rotation of one pair (x1, x2) = (x[j], x[j + D/2]) by its angle's (sin, cos): (x1 cos - x2 sin,
// x2 cos + x1 sin), each product and sum rounded to f32 (no FMA contraction), the caller rounding to T once.
// HF: as Hugging Face's apply_rotary_pos_emb computes it in T (x * cos + rotate_half(x) * sin, cos and sin
// cast to T first): cos and sin rounded to T, each product rounded to T, and each sum (in f32, as torch
// adds two T values) rounded to T. The one definition of both roundings: every body that rotates calls it
// (blockops/rope.py: rotated() is its CPU twin). In f32 the two agree.
template <class T, bool HF>
__device__ __forceinline__ float2 rope_rotate(float x1, float x2, float sn, float cs) {
    if constexpr (HF) {
        cs = round_to<T>(cs), sn = round_to<T>(sn);
        const float a = round_to<T>(__fmul_rn(x1, cs)), b = round_to<T>(__fmul_rn(x2, sn));
        const float c = round_to<T>(__fmul_rn(x2, cs)), d = round_to<T>(__fmul_rn(x1, sn));
        return make_float2(round_to<T>(__fsub_rn(a, b)), round_to<T>(__fadd_rn(c, d)));
    } else {
        return make_float2(__fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)), __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
    }
}

template <class T, int D, bool NORM, bool OUTLINE = false, bool HF = false>
__device__ __forceinline__ void rope_store(float (&x1)[rope_pairs<D>()], float (&x2)[rope_pairs<D>()], long long p,
                                           const RopeLane<D>& c, float eps, T* out, long long os) {
    constexpr int H = D / 2, PL = rope_pairs<D>();
    const int lane = threadIdx.x & 31;
    if (NORM) {
        float ss = 0.0f;
#pragma unroll
        for (int t = 0; t < PL; ++t) ss += x1[t] * x1[t] + x2[t] * x2[t];
        const float rinv = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            x1[t] = round_to<T>(round_to<T>(x1[t] * rinv) * c.g1[t]);
            x2[t] = round_to<T>(round_to<T>(x2[t] * rinv) * c.g2[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < PL; ++t) {
        const int j = t * 32 + lane;
        if (j >= H) continue;
        const float2 sc = rope_sincos<OUTLINE>(__fmul_rn((float)p, c.freq[t]));
        const float2 y = rope_rotate<T, HF>(x1[t], x2[t], sc.x, sc.y);
        out[j * os] = from_f32<T>(y.x);
        out[(j + H) * os] = from_f32<T>(y.y);
    }
}

template <class T, int D, bool NORM, bool HF = false>
__device__ __noinline__ void rope_rows(Mat<const T> x, const float* inv_freq, Vec<const int> pos_ids, long long pos,
                                       long long group, Vec<const T> g, float eps, Mat<T> out, long long rows,
                                       int rows_per, long long c0) {
    in_global(x, out);  // (not the optional pos_ids and g: an absent view is nullptr)
    const long long r0 = c0 * rows_per, r1 = min_i64(r0 + rows_per, rows);
    const RopeLane<D> lane = rope_lane<T, D, NORM>(inv_freq, g);
#pragma unroll 1
    for (long long r = r0 + (threadIdx.x >> 5); r < r1; r += MEGA_WARPS) {
        const long long p = pos_ids.p ? (long long)ld_cg(pos_ids.p + (r / group) * pos_ids.s0) : pos;
        float x1[rope_pairs<D>()], x2[rope_pairs<D>()];
        rope_load<T, D>(x.p + r * x.s0, x.s1, x1, x2);
        rope_store<T, D, NORM, false, HF>(x1, x2, p, lane, eps, out.p + r * out.s0, out.s1);
    }
}
