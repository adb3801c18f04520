// Split-KV decode attention (megaegg/blockops/attention.py is the definition).
//
// attn_partial<T, D, G>: instance (c0 = kv head, c1 = split) attends the G query heads
// c0*G .. c0*G+G-1 over cache rows [c1*chunk, min(c1*chunk + chunk, L)) and writes, per
// query head h, f32 part[h, c1, 0..D-1] = sum_j exp(s_j - m) v_j (unnormalised),
// part[h, c1, D] = m = max_j s_j, part[h, c1, D+1] = sum_j exp(s_j - m), s_j = (q.k_j)*scale.
//
// Each warp runs its own online softmax over the rows it takes (interleaved groups of
// RPI rows; LPR lanes hold a row as 16-byte vectors, so a warp instruction covers RPI
// consecutive rows); at the end the MEGA_WARPS warp states merge through shared memory.
// Fast path (unit last strides, 16-byte aligned rows): each lane streams its K and V
// pieces through a private ring of shared-memory stages filled by cp.async.cg (L2 only),
// STAGES-1 steps ahead of the one it computes: ~100 KB in flight per SM, which registers
// cannot hold next to q and the accumulators, and no block barrier until the final merge.
// Otherwise (any strides) a generic body, a row at a time (partial_generic).
// Measured (H200, bf16, G=4, L=32768, persistent): D=128 1.7 TB/s at chunk 256, 2.0-2.1 at
// chunk 1024; D=64 1.2 / 1.5. It is instruction-bound (ncu: 55% issue slots, 2 warps per
// scheduler), not bandwidth-bound. The ragged op runs q.K and p.V on tensor cores instead where
// MmaPath allows (partial_mma, below), and attn_partial too where G >= 4.
//
// attn_merge<T, D>: instance c0 combines the ceil(L/chunk) splits of query heads
// [c0*rows_per, min(c0*rows_per + rows_per, Hq)): out[h] = T(num / den), one warp a head.
// It is latency-bound: the first 16 splits' rows load together with the (max, sum)
// pairs, in one round trip, before any weight is known.
//
// attn_partial_merge<T, D, G>: both in one op (the compiler's choice for decode): the last
// split of each KV head to finish merges its G query heads, so the merge needs no hand-off.
//
// ragged_partial_merge<T, D, G>: the same for a batch's rows (each its own cache slot and length),
// with a run-time split count; on the tensor-core body for bf16 / f16, G <= 8, D 64 or 128.
#pragma once
#include "common.cuh"
#include "kv_pages.cuh"

namespace attn_impl {

constexpr float LOG2E = 1.4426950408889634f;

template <class T, int D, int G>
struct Plan {
    static_assert(D % VecN<T>::value == 0, "attention: head dim must be a multiple of 16 bytes");
    static constexpr int VEC = VecN<T>::value;
    static constexpr int DV = D / VEC;                        // 16-byte vectors per row
    static constexpr int LPR = DV >= 32 ? 32 : (DV > 16 ? 32 : DV > 8 ? 16 : DV > 4 ? 8 : DV > 2 ? 4 : DV > 1 ? 2 : 1);
    static constexpr int VPR = cdiv(DV, LPR);                 // vectors per lane per row
    static constexpr int RPI = 32 / LPR;                      // rows per warp instruction
    static constexpr int NS = G >= 8 ? 2 : 4;                 // row slots per lane per step (registers)
    static constexpr int ROWS_PER_STEP = MEGA_WARPS * RPI * NS;
    // shared memory: the warp states, then the cp.async ring (a step of K and V rows a stage)
    static constexpr int WS_BYTES = cdiv(MEGA_WARPS * G * (D + 2) * 4, 16) * 16;
    static constexpr int STAGE_BYTES = MEGA_THREADS * NS * VPR * 2 * 16;
    static constexpr int STAGES = cmin(6, (MEGA_SMEM - WS_BYTES) / STAGE_BYTES);
    static_assert(WS_BYTES <= MEGA_SMEM, "attn_partial: warp states do not fit in shared memory");
};

__device__ __forceinline__ float ex2(float x) {  // 2^x, MUFU.EX2 (2 ulp; 2^-inf = 0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Combine the warp states ws[warp][g][D + 2] (output, then max in the log2 domain and sum) of KV heads
// c0 .. c0 + nh - 1 (HPI at most; warps [i * MEGA_WARPS / HPI, (i + 1) * MEGA_WARPS / HPI) took head c0 + i),
// query heads (c0 + i)*G .. + G - 1, and write part[h, c1, :] (max in the natural-log domain).
template <int D, int G, int HPI = 1>
__device__ __forceinline__ void combine_warps(const float* ws, float* part, long long p_s0, long long p_s1, long long c0,
                                              long long c1, int nh = 1) {
    constexpr int WS = D + 2, WPH = MEGA_WARPS / HPI;
    for (int idx = threadIdx.x; idx < nh * G * (D + 1); idx += MEGA_THREADS) {  // column j of head g; j == D: max, sum
        const int hg = idx / (D + 1), j = idx % (D + 1), w0 = (hg / G) * WPH;
        float mx = MEGA_NEG_INF;
#pragma unroll
        for (int i = 0; i < WPH; ++i) mx = fmaxf(mx, ws[((w0 + i) * G + hg % G) * WS + D]);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < WPH; ++i) {
            const float* src = ws + ((w0 + i) * G + hg % G) * WS;
            const float wm = src[D];
            sum += (wm == MEGA_NEG_INF ? 0.0f : ex2(wm - mx)) * src[j == D ? D + 1 : j];
        }
        float* dst = part + (c0 * G + hg) * p_s0 + c1 * p_s1;
        if (j < D) {
            dst[j] = sum;
        } else {
            dst[D] = mx * (1.0f / LOG2E);  // natural-log domain, as the definition
            dst[D + 1] = sum;
        }
    }
}

// One warp's part of an instance: its lanes' q slices, running max / sum and output.
// Slot j of the step at `base` is row base + (j*MEGA_WARPS + warp)*RPI + rsub. Scores are
// kept in the log2 domain (scale * log2(e) folded in), so each exp is one ex2.
template <class T, int D, int G>
struct Warp {
    using P = Plan<T, D, G>;
    static constexpr int VEC = P::VEC, VPR = P::VPR, LPR = P::LPR, NS = P::NS;
    long long p1;
    float scale2;
    int warp, sub, rsub;  // sub: which vectors of a row this lane holds; rsub: which row of an instruction
    float qf[G][VPR][VEC];
    float m_run[G], l_run[G], acc[G][VPR][VEC];  // m_run: log2 domain

    __device__ __forceinline__ void init(const T* q, long long q_s0, long long p1_, float scale,
                                         long long c0) {
        const int lane = threadIdx.x & 31;
        p1 = p1_, scale2 = scale * LOG2E;
        warp = threadIdx.x >> 5, sub = lane % LPR, rsub = lane / LPR;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            m_run[g] = MEGA_NEG_INF;
            l_run[g] = 0.0f;
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                const int vi = v * LPR + sub;
                if (vi < P::DV) {
                    unpack16<T>(ldcg16(q + (c0 * G + g) * q_s0 + vi * VEC), qf[g][v]);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) qf[g][v][e] = 0.0f;
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][v][e] = 0.0f;
            }
        }
    }

    __device__ __forceinline__ int slot_row(int j) const { return (j * MEGA_WARPS + warp) * P::RPI + rsub; }

    // scores, online-softmax update and V accumulation for the NS slots of the step at `base`
    __device__ __forceinline__ void compute(const uint4 (&kr)[NS][VPR], const uint4 (&vr)[NS][VPR], long long base) {
        float s[NS][G];  // (q_g . k_row) * scale * log2(e), reduced over the row's LPR lanes
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int g = 0; g < G; ++g) s[j][g] = 0.0f;
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                float kf[VEC];
                unpack16<T>(kr[j][v], kf);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) s[j][g] = fmaf(qf[g][v][e], kf[e], s[j][g]);
            }
        }
        const long long left = p1 - base;  // rows of the step below p1, counted from base
        float m_step[G];
#pragma unroll
        for (int g = 0; g < G; ++g) m_step[g] = MEGA_NEG_INF;
#pragma unroll
        for (int j = 0; j < NS; ++j) {
            const bool ok = slot_row(j) < left;
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) s[j][g] += __shfl_xor_sync(MEGA_FULL_MASK, s[j][g], o);
                s[j][g] = ok ? s[j][g] * scale2 : MEGA_NEG_INF;
                m_step[g] = fmaxf(m_step[g], s[j][g]);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int o = 16; o >= LPR; o >>= 1) m_step[g] = fmaxf(m_step[g], __shfl_xor_sync(MEGA_FULL_MASK, m_step[g], o));
        if (m_step[0] == MEGA_NEG_INF) return;  // warp-uniform: no row of this warp in the step
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (m_step[g] > m_run[g]) {  // warp-uniform
                const float alpha = ex2(m_run[g] - m_step[g]);  // 0 while m_run = -inf
                m_run[g] = m_step[g];
                l_run[g] *= alpha;
#pragma unroll
                for (int v = 0; v < VPR; ++v)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][v][e] *= alpha;
            }
#pragma unroll
            for (int j = 0; j < NS; ++j) {  // m_run is finite here; masked rows: 2^-inf = 0
                s[j][g] = ex2(s[j][g] - m_run[g]);
                l_run[g] += s[j][g];
            }
        }
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                float vf[VEC];
                unpack16<T>(vr[j][v], vf);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][v][e] = fmaf(s[j][g], vf[e], acc[g][v][e]);
            }
    }

    // Merge the MEGA_WARPS warp states through shared memory ws and write part[h, c1, :].
    __device__ __forceinline__ void finish(float* ws, float* part, long long p_s0, long long p_s1, long long c0,
                                          long long c1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {  // sum over the RPI row lanes (l_run is replicated over a row's LPR lanes)
#pragma unroll
            for (int o = 16; o >= LPR; o >>= 1) {
                l_run[g] += __shfl_xor_sync(MEGA_FULL_MASK, l_run[g], o);
#pragma unroll
                for (int v = 0; v < VPR; ++v)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][v][e] += __shfl_xor_sync(MEGA_FULL_MASK, acc[g][v][e], o);
            }
        }
        constexpr int WS = D + 2;  // ws[warp][g][0..D-1] = acc, [D] = max (log2 domain), [D+1] = sum
        if (rsub == 0) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float* dst = ws + (warp * G + g) * WS;
#pragma unroll
                for (int v = 0; v < VPR; ++v) {
                    const int vi = v * LPR + sub;
                    if (vi < P::DV) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) dst[vi * VEC + e] = acc[g][v][e];
                    }
                }
                if (sub == 0) dst[D] = m_run[g], dst[D + 1] = l_run[g];
            }
        }
        mega_sync();
        combine_warps<D, G>(ws, part, p_s0, p_s1, c0, c1);
    }
};

// Tensor-core path (bf16 / f16, G <= 8 query heads, D 64 or 128): one warp takes BR cache rows
// a step (16 for D = 64, 8 for D = 128: 4 KB of K and V a warp), every MEGA_WARPS * BR rows, through a
// ring of its own in shared memory (RING_STAGES steps, filled by cp.async.cg, RING_STAGES - 1 steps ahead of
// the one it computes: ~150 KB in flight per SM with 200 KB of shared memory, ~75 KB with 120; no block
// barrier, the warps drift apart), and runs them on mma.sync (PTX ISA fragments; g = lane / 4, t = lane % 4):
//   S = Q K^T   m16n8k16: A = q (rows: the G heads, zero beyond), B = K (n: a cache row; each lane's
//               k pairs are one 16-byte chunk of its row: the dot product sums over d in any order,
//               so q is loaded with the same permutation: kstep j, half h of lane t <-> d = 8 * (t +
//               4 * (j / 2)) + 4 * (j % 2) + 2 * h);
//   O^T += V^T P^T  m16n8k16 (BR 16) or m16n8k8 (BR 8): A = V^T (rows: d, permuted so that a lane's rows
//               are D / 8 consecutive elements of a cache row: d-row g of m-tile mt <-> d = g * D / 8 +
//               2 * mt, row g + 8 <-> + 1), B = P^T (k: cache rows, n: heads), which is exactly S's C
//               fragment: no shuffle between the two products; O^T needs no padding (n = 8 heads).
// Each warp keeps its online-softmax state (per head row: max in the log2 domain, sum) and O^T in
// registers; the warps' states combine through shared memory as the other paths'. P is rounded to T
// for the P.V product (as flash attention does) while the sums add it in f32: the CPU definition
// keeps P in f32 throughout, so the two agree to T's rounding, not bit for bit.
// The ring replaced two steps a warp loaded straight into registers (~64 KB in flight per SM: a batch of
// 64 decoding at context 512 read its caches at ~2 TB/s, 7.9 us an instance of 128 KB; perf-notes #92).
template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    T v[2] = {from_f32<T>(lo), from_f32<T>(hi)};
    return *reinterpret_cast<const unsigned*>(v);
}
__device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <class T, int D, int G>
struct MmaPath {
    static constexpr bool ok = (SameType<T, __nv_bfloat16>::value || SameType<T, __half>::value) && G <= 8 && D % 64 == 0 &&
                               D <= 128;
};

// The warps' states ws[warp][g][D + 2] combined and normalised, KV heads as combine_warps':
// out[(c0 + i)*G + g, :] = T(num / den), as attn_merge writes a merged row (a split that is its row's only
// one needs no partials).
template <class T, int D, int G, int HPI = 1>
__device__ __forceinline__ void combine_warps_out(const float* ws, T* out, long long o_s0, long long c0, int nh = 1) {
    constexpr int WS = D + 2, WPH = MEGA_WARPS / HPI;
    for (int idx = threadIdx.x; idx < nh * G * D; idx += MEGA_THREADS) {
        const int hg = idx / D, j = idx % D, w0 = (hg / G) * WPH;
        float mx = MEGA_NEG_INF;
#pragma unroll
        for (int i = 0; i < WPH; ++i) mx = fmaxf(mx, ws[((w0 + i) * G + hg % G) * WS + D]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int i = 0; i < WPH; ++i) {
            const float* src = ws + ((w0 + i) * G + hg % G) * WS;
            const float w = src[D] == MEGA_NEG_INF ? 0.0f : ex2(src[D] - mx);
            num += w * src[j], den += w * src[D + 1];
        }
        out[(c0 * G + hg) * o_s0 + j] = from_f32<T>(num / den);
    }
}

// Ring stages a warp (each BR rows of K and V, D + 8 elements a row) that fit MEGA_SMEM: 2 to 6.
template <class T, int D> __host__ __device__ constexpr int ring_stages() {
    return cmax(2, cmin(6, MEGA_SMEM / (MEGA_WARPS * 2 * (D == 64 ? 16 : 8) * (D + 8) * (int)sizeof(T))));
}

// A paged cache's rows for partial_mma<PAGED>: row r at kh (vh) + page * ks0 (vs0) + (r % page_len) * k_s1
// (v_s1), page = table[(r / page_len) * t_s1] (the sequence's row of the page table, its pages checked).
struct PagedRows {
    const int* table;
    long long t_s1, page_len, ks0, vs0;
};

// An instance's KV heads (partial_mma<HPI>): `count` heads (HPI at most) from kh / vh, `k_hs` / `v_hs`
// elements apart.
struct KvHeads {
    long long k_hs, v_hs;
    int count;
};

// part == nullptr: write the normalised rows to out (o_s0: its head stride) instead of partials. HPI > 1: the
// instance takes KV heads c0 .. c0 + heads.count - 1, MEGA_WARPS / HPI warps each, so a batch's (row, KV head)
// pairs run as fewer, longer instances (blockops/ragged_attention.py: heads_per_instance).
template <class T, int D, int G, bool PAGED = false, int HPI = 1>
__device__ __forceinline__ void partial_mma(char* sm, const T* q, long long q_s0, const T* kh, long long k_s1,
                                            const T* vh, long long v_s1, long long p0, long long p1, float scale,
                                            float* part, long long p_s0, long long p_s1, long long c0, long long c1,
                                            T* out = nullptr, long long o_s0 = 0, PagedRows pg = {},
                                            KvHeads heads = {0, 0, 1}) {
    constexpr int BR = D == 64 ? 16 : 8;  // cache rows a warp step
    constexpr int NTS = BR / 8;           // n8 tiles of S
    constexpr int KS = D / 16;            // k16 steps of q.K
    constexpr int KC = D / 32;            // 16-byte chunks of a K row a lane loads
    constexpr int VR = BR / 4;            // cache rows of V a lane loads: 2t, 2t+1 (+ 8)
    constexpr int VC = D / 64;            // 16-byte chunks of each
    constexpr int MT = D / 16;            // m16 tiles of O^T
    constexpr int LD = D + 8;             // a ring row, elements (16-byte aligned; the V reads are conflict-free)
    constexpr int STEP = 2 * BR * LD;     // a ring stage, elements: BR rows of K, then BR of V
    constexpr int RS = ring_stages<T, D>();
    constexpr int CPR = D / 8;            // 16-byte chunks a cache row
    constexpr int CPL = 2 * BR * CPR / 32;  // chunks a lane copies a step
    static_assert(MEGA_WARPS * G * (D + 2) * 4 <= MEGA_SMEM, "attention (mma): warp states do not fit in shared memory");
    static_assert(MEGA_WARPS * RS * STEP * (int)sizeof(T) <= MEGA_SMEM, "attention (mma): the ring does not fit");
    static_assert(MEGA_WARPS % HPI == 0, "attention (mma): an instance's KV heads must share the warps evenly");
    constexpr int WPH = MEGA_WARPS / HPI;  // warps a KV head
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int head = warp / WPH, sub = warp % WPH;  // this warp's KV head of the instance, its rank among the head's
    if (head < heads.count) kh += head * heads.k_hs, vh += head * heads.v_hs;
    else p1 = p0;  // (a ragged last group: no rows; its state is -inf, zeros)
    const long long qh = (c0 + head) * G;  // the head's first query head
    const float scale2 = scale * LOG2E;
    T* ring = reinterpret_cast<T*>(sm) + warp * RS * STEP;
    struct Step {
        uint4 k[NTS][KC], v[VR][VC];
    };
    // step at r0 -> ring stage st (rows past p1: zeros, no global read); one commit group a step, empty past p1
    const auto issue = [&](int st, long long r0) {
        if (r0 < p1) {
            T* dst = ring + st * STEP;
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = lane + 32 * i, v = c / (BR * CPR), row = (c / CPR) % BR, col = 8 * (c % CPR);
                const long long r = r0 + row, rr = r < p1 ? r : r0;
                const T* src;
                if constexpr (PAGED) {  // (one L1-cached table load a chunk)
                    const long long page = ld_cg(pg.table + (rr / pg.page_len) * pg.t_s1), in_page = rr % pg.page_len;
                    src = (v ? vh + page * pg.vs0 + in_page * v_s1 : kh + page * pg.ks0 + in_page * k_s1) + col;
                } else {
                    src = (v ? vh + rr * v_s1 : kh + rr * k_s1) + col;
                }
                cp_async16(dst + (v * BR + row) * LD + col, src, r < p1 ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    // a landed step's K and V from its stage into the registers compute takes (K: 2-way bank conflicts)
    const auto load = [&](Step& s, int st) {
        const T* src = ring + st * STEP;
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
            for (int c = 0; c < KC; ++c)
                s.k[nt][c] = *reinterpret_cast<const uint4*>(src + (nt * 8 + g) * LD + 8 * (t + 4 * c));
#pragma unroll
        for (int i = 0; i < VR; ++i)
#pragma unroll
            for (int c = 0; c < VC; ++c)
                s.v[i][c] = *reinterpret_cast<const uint4*>(src + (BR + 2 * t + (i & 1) + 8 * (i >> 1)) * LD +
                                                            g * (D / 8) + 8 * c);
    };
    const long long stride = (long long)WPH * BR, base = p0 + sub * BR;  // step j: rows base + j * stride
#pragma unroll
    for (int j = 0; j < RS - 1; ++j) issue(j, base + j * stride);
    unsigned qa[KS][2];  // A of q: row g, halves 0 and 1 (rows g + 8 are zero)
#pragma unroll
    for (int c = 0; c < KC; ++c) {
        const uint4 v = g < G && p0 < p1 ? ldcg16(q + (qh + g) * q_s0 + 8 * (t + 4 * c)) : make_uint4(0, 0, 0, 0);
        qa[2 * c][0] = v.x, qa[2 * c][1] = v.y, qa[2 * c + 1][0] = v.z, qa[2 * c + 1][1] = v.w;
    }
    float o[MT][4];  // O^T: d-rows (g, g + 8) of m-tile mt x heads (2t, 2t + 1)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m_run = MEGA_NEG_INF, l_run = 0.0f;  // head g's (l_run: this lane's columns)
    const auto compute = [&](const Step& st, long long r0) {  // r0 < p1
        float sc[NTS][4];
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < KS; ++j)
                mma16816<T>(sc[nt], qa[j][0], 0u, qa[j][1], 0u, word(st.k[nt][j / 2], 2 * (j % 2)),
                             word(st.k[nt][j / 2], 2 * (j % 2) + 1));
        }
        float mx = MEGA_NEG_INF;  // head g's scores (log2 domain) of cache rows r0 + nt * 8 + 2t (+1)
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool in = r0 + nt * 8 + 2 * t + e < p1;
                sc[nt][e] = in ? sc[nt][e] * scale2 : MEGA_NEG_INF;
                mx = fmaxf(mx, sc[nt][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(MEGA_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(MEGA_FULL_MASK, mx, 2));
        const float m_new = fmaxf(m_run, mx);  // finite: row r0 is below p1
        const float alpha = ex2(m_run - m_new);  // 0 while m_run = -inf
        m_run = m_new;
        unsigned pb[NTS];  // B of P^T: cache rows 2t, 2t + 1 of S tile nt, head g
        float psum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt) {
            const float e0 = ex2(sc[nt][0] - m_new), e1 = ex2(sc[nt][1] - m_new);
            psum += e0 + e1;
            pb[nt] = pack2<T>(e0, e1);
        }
        l_run = l_run * alpha + psum;
        // O^T's columns are heads 2t, 2t + 1: their rescale factors from the lanes holding those rows
        const float a0 = __shfl_sync(MEGA_FULL_MASK, alpha, 8 * t), a1 = __shfl_sync(MEGA_FULL_MASK, alpha, 8 * t + 4);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            o[mt][0] *= a0, o[mt][1] *= a1, o[mt][2] *= a0, o[mt][3] *= a1;
            const int c = mt / 4, w = mt % 4;  // elements 2mt, 2mt + 1 of the lane's D / 8: word w of chunk c
            const unsigned lo = __byte_perm(word(st.v[0][c], w), word(st.v[1][c], w), 0x5410);  // d-row g, rows 2t, 2t+1
            const unsigned hi = __byte_perm(word(st.v[0][c], w), word(st.v[1][c], w), 0x7632);  // d-row g + 8
            if constexpr (NTS == 2) {
                const unsigned lo8 = __byte_perm(word(st.v[2][c], w), word(st.v[3][c], w), 0x5410);  // rows 2t+8, 2t+9
                const unsigned hi8 = __byte_perm(word(st.v[2][c], w), word(st.v[3][c], w), 0x7632);
                mma16816<T>(o[mt], lo, hi, lo8, hi8, pb[0], pb[NTS - 1]);
            } else {
                mma1688<T>(o[mt], lo, hi, pb[0]);
            }
        }
    };
#pragma unroll 1
    for (int j = 0; base + j * stride < p1; ++j) {  // (warp-uniform bounds)
        cp_async_wait<RS - 2>();  // step j landed (this lane's chunks) ...
        __syncwarp();             // ... and the warp's; every lane is done with step j - 1's stage
        issue((j + RS - 1) % RS, base + (j + RS - 1) * stride);  // (into step j - 1's stage)
        Step st;
        load(st, j % RS);
        compute(st, base + j * stride);
    }
    cp_async_wait<0>();  // (only empty groups are left: none writes the ring again)
    l_run += __shfl_xor_sync(MEGA_FULL_MASK, l_run, 1);
    l_run += __shfl_xor_sync(MEGA_FULL_MASK, l_run, 2);
    // this warp's state: ws[warp][h][0..D-1] = O (unnormalised), [D] = max, [D + 1] = sum (a warp with
    // no rows: max -inf, zeros); ws overlaps other warps' rings: every warp is done with its own first
    constexpr int WS = D + 2;
    float* ws = reinterpret_cast<float*>(sm);
    mega_sync();
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * t + e;
        if (h < G) {
            float* dst = ws + (warp * G + h) * WS + g * (D / 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) dst[2 * mt] = o[mt][e], dst[2 * mt + 1] = o[mt][2 + e];
        }
    }
    if (t == 0 && g < G) ws[(warp * G + g) * WS + D] = m_run, ws[(warp * G + g) * WS + D + 1] = l_run;
    mega_sync();
    if (part == nullptr)
        combine_warps_out<T, D, G, HPI>(ws, out, o_s0, c0, heads.count);
    else
        combine_warps<D, G, HPI>(ws, part, p_s0, p_s1, c0, c1, heads.count);
}

// Fast path: every lane streams the 16-byte pieces of K and V it will read (its slots of
// each step) through its own STAGES-deep cp.async ring in shared memory. The data is
// lane-private, so no barrier is needed: warps drift apart and overlap each other's compute.
template <class T, int D, int G>
__device__ __forceinline__ void partial_async(char* sm, const T* q, long long q_s0, const T* kh, long long k_s1,
                                              const T* vh, long long v_s1, long long p0, long long p1, float scale,
                                              float* part, long long p_s0, long long p_s1, long long c0, long long c1) {
    using P = Plan<T, D, G>;
    constexpr int VEC = P::VEC, VPR = P::VPR, LPR = P::LPR, NS = P::NS, S = P::STAGES;
    constexpr int PIECES = NS * VPR * 2;  // per lane and stage: [slot][vector][K, V]
    Warp<T, D, G> w;
    w.init(q, q_s0, p1, scale, c0);
    // ring[stage][piece][thread]: 16-byte pieces, consecutive lanes adjacent (conflict-free)
    uint4* ring = reinterpret_cast<uint4*>(sm + P::WS_BYTES) + threadIdx.x;
    const long long stride = P::ROWS_PER_STEP;
    const long long first = p0 + w.slot_row(0);  // this lane's row in slot 0 of step 0
    // The block's step count, the same in every lane (a warp whose rows end sooner runs masked
    // steps: zero-filled copies, no global reads): with a per-lane count the compiler cannot
    // prove the warp converged at compute()'s shuffles and emits a second, collective copy of
    // each (~10 KB of SASS).
    const long long n_steps = p1 > p0 ? (p1 - p0 + stride - 1) / stride : 0;
    // lane pointers into K and V at step 0 (row `first`, or the head's row 0 when past the end)
    const T* kl = kh + w.sub * VEC;
    const T* vl = vh + w.sub * VEC;
    const long long slot_k = (long long)MEGA_WARPS * P::RPI * k_s1, slot_v = (long long)MEGA_WARPS * P::RPI * v_s1;
    auto issue = [&](long long t, int stage) {
        const long long r = first + t * stride;
        uint4* dst = ring + stage * PIECES * MEGA_THREADS;
        const T* kp = kl + r * k_s1;
        const T* vp = vl + r * v_s1;
#pragma unroll
        for (int j = 0; j < NS; ++j) {
            const bool ok = r + j * MEGA_WARPS * P::RPI < p1;  // else zero-filled, no global read
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                const bool in = ok && v * LPR + w.sub < P::DV;
                // (a zero fill's dummy source: the split's first row, inside a paged cache's page too)
                cp_async16(dst + ((j * VPR + v) * 2) * MEGA_THREADS, in ? kp + j * slot_k + v * LPR * VEC : kh + p0 * k_s1,
                           in ? 16 : 0);
                cp_async16(dst + ((j * VPR + v) * 2 + 1) * MEGA_THREADS, in ? vp + j * slot_v + v * LPR * VEC : vh + p0 * v_s1,
                           in ? 16 : 0);
            }
        }
    };
#pragma unroll
    for (int t = 0; t < S - 1; ++t) {
        if (t < n_steps) issue(t, t);
        cp_async_commit();
    }
    int stage = 0;  // stage of step t; step t + S - 1 goes to the stage of step t - 1
#pragma unroll 1
    for (long long t = 0; t < n_steps; ++t) {
        if (t + S - 1 < n_steps) issue(t + S - 1, stage == 0 ? S - 1 : stage - 1);  // read at step t-1: done
        cp_async_commit();
        cp_async_wait<S - 1>();  // step t's pieces have landed
        const uint4* src = ring + stage * PIECES * MEGA_THREADS;
        uint4 kr[NS][VPR], vr[NS][VPR];
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                kr[j][v] = src[((j * VPR + v) * 2) * MEGA_THREADS];
                vr[j][v] = src[((j * VPR + v) * 2 + 1) * MEGA_THREADS];
            }
        w.compute(kr, vr, p0 + t * stride);
        stage = stage == S - 1 ? 0 : stage + 1;
    }
    cp_async_wait<0>();
    w.finish(reinterpret_cast<float*>(sm), part, p_s0, p_s1, c0, c1);
}

// Vector loads straight into registers, one step at a time (no cp.async ring fits).
template <class T, int D, int G>
__device__ __forceinline__ void partial_regs(char* sm, const T* q, long long q_s0, const T* kh, long long k_s1,
                                             const T* vh, long long v_s1, long long p0, long long p1, float scale,
                                             float* part, long long p_s0, long long p_s1, long long c0, long long c1) {
    using P = Plan<T, D, G>;
    constexpr int VEC = P::VEC, VPR = P::VPR, LPR = P::LPR, NS = P::NS;
    Warp<T, D, G> w;
    w.init(q, q_s0, p1, scale, c0);
#pragma unroll 1
    for (long long base = p0; base < p1; base += P::ROWS_PER_STEP) {  // (uniform: see partial_async)
        uint4 kr[NS][VPR], vr[NS][VPR];
#pragma unroll
        for (int j = 0; j < NS; ++j) {
            const long long r = base + w.slot_row(j);
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                const int vi = v * LPR + w.sub;
                const bool ok = r < p1 && vi < P::DV;
                kr[j][v] = ok ? ldcg16(kh + r * k_s1 + vi * VEC) : make_uint4(0, 0, 0, 0);
                vr[j][v] = ok ? ldcg16(vh + r * v_s1 + vi * VEC) : make_uint4(0, 0, 0, 0);
            }
        }
        w.compute(kr, vr, base);
    }
    w.finish(reinterpret_cast<float*>(sm), part, p_s0, p_s1, c0, c1);
}

// Any strides and alignments, one generic copy per element type (D and G runtime values): one
// warp a query head, a row at a time. Correct and slow; the compiler's own caches and q never take
// it, and keeping it out of the shape templates keeps each of them ~35 KB of SASS smaller.
// Writes what Warp::finish writes: part[h, c1, :D] = sum_j 2^(s_j - m) v_j, [D] = m (natural
// log domain), [D+1] = sum_j 2^(s_j - m), s_j the log2-domain scores.
template <class T>
__device__ __noinline__ void partial_generic(char* sm, int D, int G, const T* q, long long q_s0, long long q_s1,
                                             const T* kh, long long k_s1, long long k_s2, const T* vh, long long v_s1,
                                             long long v_s2, long long p0, long long p1, float scale, float* part,
                                             long long p_s0, long long p_s1, long long c0, long long c1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* acc = reinterpret_cast<float*>(sm) + warp * D;  // this warp's head's running output
    const float scale2 = scale * LOG2E;
#pragma unroll 1
    for (int g = warp; g < G; g += MEGA_WARPS) {
        const T* qh = q + (c0 * G + g) * q_s0;
        float m = MEGA_NEG_INF, l = 0.0f;
        for (int d = lane; d < D; d += 32) acc[d] = 0.0f;
#pragma unroll 1
        for (long long r = p0; r < p1; ++r) {
            float s = 0.0f;
            for (int d = lane; d < D; d += 32) s = fmaf(ld_f32(qh + d * q_s1), ld_f32(kh + r * k_s1 + d * k_s2), s);
            s = warp_sum(s) * scale2;
            const float m_new = fmaxf(m, s), alpha = ex2(m - m_new), p = ex2(s - m_new);  // (2^-inf = 0)
            m = m_new;
            l = l * alpha + p;
            for (int d = lane; d < D; d += 32) acc[d] = acc[d] * alpha + p * ld_f32(vh + r * v_s1 + d * v_s2);
        }
        float* dst = part + (c0 * G + g) * p_s0 + c1 * p_s1;
        for (int d = lane; d < D; d += 32) dst[d] = acc[d];
        if (lane == 0) dst[D] = m * (1.0f / LOG2E), dst[D + 1] = l;
    }
}

}  // namespace attn_impl

// Unit last strides and 16-byte aligned rows of q and KV head c0's caches: the vector paths' loads.
template <class T>
__device__ __forceinline__ bool attn_vec_ok(Mat<const T> q, Ten3<const T> kc, Ten3<const T> vc, long long c0) {
    const int bytes = (int)sizeof(T);
    return q.s1 == 1 && kc.s2 == 1 && vc.s2 == 1 && aligned16(q.p) && aligned16(kc.p + c0 * kc.s0) &&
           aligned16(vc.p + c0 * vc.s0) && ((q.s0 * bytes) & 15) == 0 && ((kc.s1 * bytes) & 15) == 0 &&
           ((vc.s1 * bytes) & 15) == 0;
}

// The tensor-core body (partial_mma) where it applies and G >= 4 query heads share a KV head: the CUDA-core
// body's instructions grow with G and it is latency-bound (2 warps a scheduler). Traced at context 512, one
// 128-row step of llama-3.2-1b's G = 4, D = 64 computed for 1.3 us, and a qwen3-30b-a3b split (G = 8, D = 128)
// spent 6.6 us after its K and V had landed; on tensor cores llama-3.2-1b -4.1%, qwen3-8b -1.1%, qwen3-30b-a3b
// -6.5%. At G = 2 (qwen3-0.6b) the MMAs' rows are 2 of 16 and it lost 2.5% (perf-notes #110).
template <class T, int D, int G>
__device__ __noinline__ void attn_partial(char* smem, Mat<const T> q, Ten3<const T> kc, Ten3<const T> vc, long long L,
                                          long long chunk, float scale, Mat<float> part, long long c0, long long c1) {
    in_global(q, kc, vc, part);
    using P = attn_impl::Plan<T, D, G>;
    char* sm = shared_ptr(smem);
    const long long p0 = c1 * chunk, p1 = min_i64(p0 + chunk, L);
    const T* kh = kc.p + c0 * kc.s0;
    const T* vh = vc.p + c0 * vc.s0;
    if (attn_vec_ok(q, kc, vc, c0)) {
        if constexpr (attn_impl::MmaPath<T, D, G>::ok && G >= 4)
            attn_impl::partial_mma<T, D, G>(sm, q.p, q.s0, kh, kc.s1, vh, vc.s1, p0, p1, scale, part.p, part.s0, part.s1, c0, c1);
        else if constexpr (P::STAGES >= 2)
            attn_impl::partial_async<T, D, G>(sm, q.p, q.s0, kh, kc.s1, vh, vc.s1, p0, p1, scale, part.p, part.s0, part.s1, c0, c1);
        else
            attn_impl::partial_regs<T, D, G>(sm, q.p, q.s0, kh, kc.s1, vh, vc.s1, p0, p1, scale, part.p, part.s0, part.s1, c0, c1);
    } else {
        attn_impl::partial_generic<T>(sm, D, G, q.p, q.s0, q.s1, kh, kc.s1, kc.s2, vh, vc.s1, vc.s2, p0, p1, scale, part.p, part.s0,
                                      part.s1, c0, c1);
    }
}

template <class T, int D>
__device__ __noinline__ void attn_merge(Mat<const float> part, long long L, long long chunk, long long Hq, int rows_per,
                                        Mat<T> out, long long c0) {
    in_global(part, out);
    constexpr int DL = cdiv(D, 32);  // output columns per lane
    constexpr int B = 16;            // splits whose rows a lane loads up front
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long nsplit = (L + chunk - 1) / chunk;
    for (int i = warp; i < rows_per; i += MEGA_WARPS) {
        const long long h = c0 * rows_per + i;
        if (h >= Hq) break;
        const float* ph = part.p + h * part.s0;
        // One round trip for short contexts: the first B splits' rows and split `lane`'s
        // (max, sum) are all in flight at once (the loads need no weight yet).
        float rows[B][DL];
#pragma unroll
        for (int t = 0; t < B; ++t)
#pragma unroll
            for (int c = 0; c < DL; ++c)
                rows[t][c] = t < nsplit && c * 32 + lane < D ? ld_cg(ph + t * part.s1 + c * 32 + lane) : 0.0f;
        const float m_own = lane < nsplit ? ld_cg(ph + lane * part.s1 + D) : MEGA_NEG_INF;
        const float l_own = lane < nsplit ? ld_cg(ph + lane * part.s1 + D + 1) : 0.0f;
        float mx = m_own;
        for (long long s = lane + 32; s < nsplit; s += 32) mx = fmaxf(mx, ld_cg(ph + s * part.s1 + D));
        mx = warp_max(mx);
        float num[DL], den = 0.0f;
#pragma unroll
        for (int c = 0; c < DL; ++c) num[c] = 0.0f;
        for (long long s0 = 0; s0 < nsplit; s0 += 32) {
            // lane t weighs split s0 + t; the warp then walks the 32 splits
            const long long s = s0 + lane;
            const float ms = s0 == 0 ? m_own : s < nsplit ? ld_cg(ph + s * part.s1 + D) : MEGA_NEG_INF;
            const float ls = s0 == 0 ? l_own : s < nsplit ? ld_cg(ph + s * part.s1 + D + 1) : 0.0f;
            const float ws = s < nsplit ? exp2f((ms - mx) * attn_impl::LOG2E) : 0.0f;
            den += ws * ls;
            const int n = (int)min_i64(32, nsplit - s0);
            int t = 0;
            if (s0 == 0) {  // the rows already in registers
#pragma unroll
                for (int u = 0; u < B; ++u) {
                    const float wt = __shfl_sync(MEGA_FULL_MASK, ws, u);
#pragma unroll
                    for (int c = 0; c < DL; ++c) num[c] = fmaf(wt, rows[u][c], num[c]);  // (0 beyond nsplit)
                }
                t = B;
            }
#pragma unroll 4
            for (; t < n; ++t) {
                const float wt = __shfl_sync(MEGA_FULL_MASK, ws, t);
                const float* row = ph + (s0 + t) * part.s1;
#pragma unroll
                for (int c = 0; c < DL; ++c)
                    if (c * 32 + lane < D) num[c] = fmaf(wt, ld_cg(row + c * 32 + lane), num[c]);
            }
        }
        den = warp_sum(den);
#pragma unroll
        for (int c = 0; c < DL; ++c)
            if (c * 32 + lane < D) out.p[h * out.s0 + (c * 32 + lane) * out.s1] = from_f32<T>(num[c] / den);
    }
}

// attn_partial_merge<T, D, G>: attn_partial, then the last of KV head c0's splits to finish merges
// its G query heads (attn_merge with rows_per = G): no merge op, and no hand-off to one. The
// block's partial stores, a block barrier, then thread 0's acq_rel add to the head's arrival
// counter `arrive[c0]` (in the launch-zeroed counter bank): as the counter protocol's signal, it
// releases the block's stores, and the instance that sees nsplit - 1 acquires every other
// split's (docs/barriers.md). Only that instance writes out; the op's own signal follows the body.
template <class T, int D, int G>
__device__ __noinline__ void attn_partial_merge(char* smem, Mat<const T> q, Ten3<const T> kc, Ten3<const T> vc,
                                                long long L, long long chunk, float scale, Mat<float> part,
                                                unsigned* arrive, Mat<T> out, long long c0, long long c1) {
    in_global(q, kc, vc, part, out);
    attn_partial<T, D, G>(smem, q, kc, vc, L, chunk, scale, part, c0, c1);
    // (c0 + 1) * G: the merge's bound on query heads, never reached (the head's G query heads exist)
    if (mega_last_arrival(arrive + c0, (unsigned)((L + chunk - 1) / chunk)))
        attn_merge<T, D>(Mat<const float>{part.p, part.s0, part.s1}, L, chunk, (c0 + 1) * G, G, out, c0);
}

// Ragged attention (blockops/ragged_attention.py): row c0 of q attends cache rows [0, pos[c0]] of
// slot slot[c0]; the same bodies on the row's q, cache slot and partials. A position or slot
// outside the cache reports MEGA_ERR_INDEX (detail: the value) and writes nothing.
__device__ __forceinline__ bool ragged_row_ok(long long p, long long max_len, long long s, long long slots) {
    if (p >= 0 && p < max_len && s >= 0 && s < slots) return true;
    if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, p < 0 || p >= max_len ? p : s);
    return false;  // uniform: every thread read the same values
}

// ragged_partial_merge<T, D, G, PAGING, HPI>: row c0's KV heads c1*HPI .. c1*HPI + HPI - 1 (those below Hkv),
// split c2 of `splits`. The split count is a run-time value (the op's launch count: blockops/ragged_attention.py
// picks it so that a batch's rows x KV head groups x splits fill about one wave of SMs), each split `chunk =
// ceil(length / splits)` cache rows of the op's bound `length`; the row has ceil((pos + 1) / chunk) of them, and
// an instance past those does nothing. A paged cache (pages.table): PAGING 2, the tensor-core body finds each
// row's page in the table (the split's pages checked first); PAGING 1 (the other bodies), split c2 is page c2
// of the row's sequence (chunk = page_len), read as a cache of one page. Partials go to part[c0, Hq, splits,
// D + 2]; the last of the row's splits for this head group to arrive (a counter per (row, group) in the
// launch-zeroed counter bank, as attn_partial_merge) merges them into the group's query heads of out[c0].
// HPI (1, 2 or 4) > 1 in the op that runs where a batch's rows alone fill a wave; on the tensor-core body a warp
// group takes each head; off it, the heads run one after another. A position outside min(rows, length), a slot
// outside the cache or a page outside the pool reports MEGA_ERR_INDEX and writes nothing.
template <class T, int D, int G, int PAGING, int HPI>
__device__ __noinline__ void ragged_partial_merge(char* smem, Ten3<const T> q, Ten4<const T> kc, Ten4<const T> vc,
                                                  Vec<const int> pos, Vec<const int> slot, KvPages pages,
                                                  long long length, long long splits, long long Hkv, float scale,
                                                  float* part, unsigned* arrive, Ten3<T> out, long long c0, long long c1,
                                                  long long c2, const MegaWaits& wl) {
    static_assert(PAGING != 2 || attn_impl::MmaPath<T, D, G>::ok, "ragged_partial_merge: rows through the page table "
                  "on the tensor-core body only (blockops/ragged_attention.py: paged)");
    in_global(q, kc, vc, pos, slot, out);
    const long long bound = min_i64(pages.rows, length);
    const long long h0 = c1 * HPI;               // the group's first KV head
    const int nh = (int)min_i64(HPI, Hkv - h0);  // its heads (fewer in a ragged last group)
    const long long chunk = PAGING == 1 ? pages.page_len : (length + splits - 1) / splits;
    const auto page_at = [&](long long s, long long j) -> long long {  // page j of sequence s (-1: outside the pool)
        const long long page = ld_cg(pages.table.p + s * pages.table.s0 + j * pages.table.s1);
        return page >= 0 && page < pages.count ? page : -1;
    };
    // Before the wait on q's and the new cache row's producers: this instance's cache rows (all but the new
    // one written by earlier steps) start streaming into L2, one bulk prefetch each of K and V a contiguous
    // run (a page), so the body's loads after the wait find them there instead of paying a round trip per
    // two register steps (perf-notes #89). Only a prefetch: a position, slot or page read before the wait
    // (an input, or stale) can only make it useless; it stays inside the caches.
    if (threadIdx.x == 0) {
        const long long p = pos.p[c0 * pos.s0], s = slot.p[c0 * slot.s0], r0 = c2 * chunk;
        if (p >= 0 && p < bound && s >= 0 && s < pages.slots && r0 <= p && kc.s3 == 1 && vc.s3 == 1 && kc.s2 == D &&
            vc.s2 == D) {
            const long long r1 = min_i64(r0 + chunk, p + 1);
            for (long long r = r0; r < r1;) {  // (a cache of slots: one run)
                const long long page = PAGING ? page_at(s, r / pages.page_len) : s;
                const long long row = PAGING ? r % pages.page_len : r, n = min_i64(r1 - r, pages.page_len - row);
                for (int h = 0; h < nh && page >= 0; ++h) {
                    mega_prefetch_l2_range(kc.p + page * kc.s0 + (h0 + h) * kc.s1 + row * D, n * D * (long long)sizeof(T));
                    mega_prefetch_l2_range(vc.p + page * vc.s0 + (h0 + h) * vc.s1 + row * D, n * D * (long long)sizeof(T));
                }
                r += n;
            }
        }
    }
    if (!mega_wait_all(wl)) return;
    const long long p = pos.p[c0 * pos.s0], s = slot.p[c0 * slot.s0];
    if (!ragged_row_ok(p, bound, s, pages.slots)) return;
    const long long nsplit = (p + chunk) / chunk;  // ceil((p + 1) / chunk)
    if (c2 >= nsplit) return;  // past the row's length: no work, no arrival
    const long long r0 = c2 * chunk, r1 = min_i64(r0 + chunk, p + 1);
    if constexpr (PAGING != 0) {  // the split's pages, checked before any copy (uniform: every thread agrees)
        __shared__ int bad_page, any_bad;
        if (threadIdx.x == 0) any_bad = 0;
        mega_sync();
        for (long long j = r0 / pages.page_len + threadIdx.x; j <= (r1 - 1) / pages.page_len; j += MEGA_THREADS)
            if (page_at(s, j) < 0 && atomicCAS(&any_bad, 0, 1) == 0)
                bad_page = ld_cg(pages.table.p + s * pages.table.s0 + j * pages.table.s1);
        mega_sync();
        if (any_bad) {
            if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, bad_page);
            return;
        }
    }
    const Mat<const T> qr = q.at(c0);
    // the slot's rows (PAGING 0), a page's with row 0 at logical row `first` (PAGING 1: a page's view starts
    // `first` rows before its memory; the bodies read only rows [r0, r1), which are the page's), or page 0's
    // (PAGING 2: the body adds each row's page)
    const long long at = PAGING == 1 ? page_at(s, c2) : PAGING == 2 ? 0 : s, first = PAGING == 1 ? r0 : 0;
    Ten3<const T> kr = kc.at(at), vr = vc.at(at);
    kr.p -= first * kr.s1, vr.p -= first * vr.s1;
    const long long hs = splits * (D + 2);  // a query head's partials
    const Mat<float> pr{part + c0 * Hkv * G * hs, hs, D + 2};
    const int bytes = (int)sizeof(T);
    const bool mma = attn_impl::MmaPath<T, D, G>::ok && attn_vec_ok(qr, kr, vr, h0) && out.s2 == 1 &&
                     (nh == 1 || (((kr.s0 * bytes) & 15) == 0 && ((vr.s0 * bytes) & 15) == 0));
    if constexpr (attn_impl::MmaPath<T, D, G>::ok) {
        if (mma) {  // the row's only split writes its output from the block's combine; else its partials
            const bool only = nsplit == 1;
            attn_impl::partial_mma<T, D, G, PAGING == 2, HPI>(
                shared_ptr(smem), qr.p, qr.s0, kr.p + h0 * kr.s0, kr.s1, vr.p + h0 * vr.s0, vr.s1, r0, r1, scale,
                only ? nullptr : pr.p, pr.s0, pr.s1, h0, c2, out.p + c0 * out.s0, out.s1,
                attn_impl::PagedRows{pages.table.p + s * pages.table.s0, pages.table.s1, pages.page_len, kc.s0, vc.s0},
                attn_impl::KvHeads{kr.s0, vr.s0, nh});
            if (only) return;
        }
    }
    if (!mma) {
        if (PAGING == 2) {  // (the caches' layout is the graph's: not reached)
            if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
            return;
        }
        for (int h = 0; h < nh; ++h) {
            if (h) mega_sync();  // (the shared memory of the head before)
            attn_partial<T, D, G>(smem, qr, kr, vr, p + 1, chunk, scale, pr, h0 + h, c2);
        }
    }
    if (mega_last_arrival(arrive + c0 * Hkv + c1, (unsigned)nsplit))  // (the last split merges)
        attn_merge<T, D>(Mat<const float>{pr.p, pr.s0, pr.s1}, p + 1, chunk, (h0 + nh) * G, HPI * G, out.at(c0), c1);
}
