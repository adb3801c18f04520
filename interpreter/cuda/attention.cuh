// Split-KV decode attention (megaegg/blockops/attention.py is the definition).
//
// attn_partial<T, D, G>: instance (c0 = kv head, c1 = split) attends the G query heads
// c0*G .. c0*G+G-1 over cache rows [c1*chunk, min(c1*chunk + chunk, L)) and writes, per
// query head h, f32 part[h, c1, 0..D-1] = sum_j exp(s_j - m) v_j (unnormalised),
// part[h, c1, D] = m = max_j s_j, part[h, c1, D+1] = sum_j exp(s_j - m), s_j = (q.k_j)*scale.
//
// Each warp runs its own online softmax over the rows it takes (no block barrier until
// the end): LPR lanes cover one cache row with 16-byte __ldcg loads (a warp instruction
// reads RPI = 32/LPR consecutive rows, coalesced), and a lane keeps NS row slots of K and
// V in flight per step; row groups interleave across warps. At the end the MEGA_WARPS warp states merge through shared
// memory (MEGA_WARPS * G * (D+2) floats).
//
// attn_merge<T, D>: instance c0 combines the ceil(L/chunk) splits of query heads
// [c0*rows_per, min(c0*rows_per + rows_per, Hq)): out[h] = T(num / den), one warp a head.
#pragma once
#include "common.cuh"

namespace attn {

constexpr float LOG2E = 1.4426950408889634f;

template <class T, int D, int G>
struct Plan {
    static constexpr int VEC = VecN<T>::value;
    static constexpr int DV = D / VEC;                        // 16-byte vectors per row
    static constexpr int LPR = DV >= 32 ? 32 : (DV > 16 ? 32 : DV > 8 ? 16 : DV > 4 ? 8 : DV > 2 ? 4 : DV > 1 ? 2 : 1);
    static constexpr int VPR = cdiv(DV, LPR);                 // vectors per lane per row
    static constexpr int RPI = 32 / LPR;                      // rows per warp instruction
    // Row slots per lane per step: K + V data (8 regs a vector) and G scores a slot, in
    // what is left of ~168 registers after q and the accumulators (2 * G * VPR * VEC).
    static constexpr int NS = cmax(2, cmin(8, (168 - 2 * G * VPR * VEC) / (8 * VPR + G)));
    static constexpr int ROWS_PER_STEP = RPI * NS;            // per warp and step
    static_assert(D % VEC == 0, "attention: head dim must be a multiple of 16 bytes");
};

// Load VEC elements of T at p (last-dim stride s2) into a 16-byte register vector.
template <class T, bool VEC_OK>
__device__ __forceinline__ uint4 load_row_vec(const T* p, long long s2) {
    if (VEC_OK) return ldcg16(p);
    float f[VecN<T>::value];
#pragma unroll
    for (int e = 0; e < VecN<T>::value; ++e) f[e] = ld_f32(p + e * s2);
    return pack16<T>(f);  // exact: the values are T
}

template <class T, int D, int G, bool VEC_OK>
__device__ __forceinline__ void partial(char* smem, const T* q, long long q_s0, long long q_s1, const T* kc,
                                        long long k_s0, long long k_s1, long long k_s2, const T* vc,
                                        long long v_s0, long long v_s1, long long v_s2, long long L,
                                        long long chunk, float scale, float* part, long long p_s0,
                                        long long p_s1, long long c0, long long c1) {
    using P = Plan<T, D, G>;
    constexpr int VEC = P::VEC, VPR = P::VPR, LPR = P::LPR, NS = P::NS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % LPR;   // which vectors of the row this lane holds
    const int rsub = lane / LPR;  // which row of a warp instruction
    const long long p0 = c1 * chunk, p1 = min_i64(p0 + chunk, L);
    const T* kh = kc + c0 * k_s0;
    const T* vh = vc + c0 * v_s0;

    // q slices of this lane: q[g][v*LPR + sub] (VEC elements each)
    float qf[G][VPR][VEC];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int v = 0; v < VPR; ++v) {
            const int vi = v * LPR + sub;
            if (vi < P::DV) {
                unpack16<T>(load_row_vec<T, VEC_OK>(q + (c0 * G + g) * q_s0 + vi * VEC * q_s1, q_s1), qf[g][v]);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) qf[g][v][e] = 0.0f;
            }
        }

    float m_run[G], l_run[G], acc[G][VPR][VEC];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m_run[g] = MEGA_NEG_INF;
        l_run[g] = 0.0f;
#pragma unroll
        for (int v = 0; v < VPR; ++v)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][v][e] = 0.0f;
    }

    // step rows: slot j of warp w holds rows base + (j*MEGA_WARPS + w)*RPI + [0, RPI) (interleaved, so
    // every warp has rows even when chunk < MEGA_WARPS*ROWS_PER_STEP); slot 0's first row is < p1.
#pragma unroll 1
    for (long long base = p0; base + (long long)warp * P::RPI < p1; base += (long long)MEGA_WARPS * P::ROWS_PER_STEP) {
        // issue every K and V load of the step
        uint4 kr[NS][VPR], vr[NS][VPR];
#pragma unroll
        for (int j = 0; j < NS; ++j) {
            const long long row = base + (j * MEGA_WARPS + warp) * P::RPI + rsub;
#pragma unroll
            for (int v = 0; v < VPR; ++v) {
                const int vi = v * LPR + sub;
                const bool ok = row < p1 && vi < P::DV;
                kr[j][v] = ok ? load_row_vec<T, VEC_OK>(kh + row * k_s1 + vi * VEC * k_s2, k_s2) : make_uint4(0, 0, 0, 0);
                vr[j][v] = ok ? load_row_vec<T, VEC_OK>(vh + row * v_s1 + vi * VEC * v_s2, v_s2) : make_uint4(0, 0, 0, 0);
            }
        }
        // scores s[j][g] = (q_g . k_row) * scale, reduced over the row's LPR lanes
        float s[NS][G];
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
        float m_step[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            m_step[g] = MEGA_NEG_INF;
#pragma unroll
            for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) s[j][g] += __shfl_xor_sync(MEGA_FULL_MASK, s[j][g], o);
                s[j][g] = base + (j * MEGA_WARPS + warp) * P::RPI + rsub < p1 ? s[j][g] * scale : MEGA_NEG_INF;
                m_step[g] = fmaxf(m_step[g], s[j][g]);
            }
#pragma unroll
            for (int o = 16; o >= LPR; o >>= 1) m_step[g] = fmaxf(m_step[g], __shfl_xor_sync(MEGA_FULL_MASK, m_step[g], o));
        }
        // online softmax update (m_step is finite: slot 0's first row is < p1)
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_new = fmaxf(m_run[g], m_step[g]);
            const float alpha = exp2f((m_run[g] - m_new) * LOG2E);  // 0 while m_run = -inf
            m_run[g] = m_new;
            l_run[g] *= alpha;
#pragma unroll
            for (int v = 0; v < VPR; ++v)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][v][e] *= alpha;
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                s[j][g] = exp2f((s[j][g] - m_new) * LOG2E);  // masked rows: exp(-inf) = 0
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

    // warp state: sum over the RPI row lanes (l_run is replicated over the LPR lanes of a row)
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int o = 16; o >= LPR; o >>= 1) {
            l_run[g] += __shfl_xor_sync(MEGA_FULL_MASK, l_run[g], o);
#pragma unroll
            for (int v = 0; v < VPR; ++v)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][v][e] += __shfl_xor_sync(MEGA_FULL_MASK, acc[g][v][e], o);
        }
    }
    float* ws = reinterpret_cast<float*>(smem);  // [MEGA_WARPS][G][D + 2]
    constexpr int WS = D + 2;
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
    __syncthreads();
    // merge the warp states: column j < D of head g, or (j == D) the max and the sum
    for (int idx = threadIdx.x; idx < G * (D + 1); idx += MEGA_THREADS) {
        const int g = idx / (D + 1), j = idx % (D + 1);
        float mx = MEGA_NEG_INF;
#pragma unroll
        for (int w = 0; w < MEGA_WARPS; ++w) mx = fmaxf(mx, ws[(w * G + g) * WS + D]);
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < MEGA_WARPS; ++w) {
            const float* src = ws + (w * G + g) * WS;
            const float wm = src[D];
            const float wgt = wm == MEGA_NEG_INF ? 0.0f : exp2f((wm - mx) * LOG2E);
            sum += wgt * src[j == D ? D + 1 : j];
        }
        float* dst = part + (c0 * G + g) * p_s0 + c1 * p_s1;
        if (j < D) {
            dst[j] = sum;
        } else {
            dst[D] = mx;
            dst[D + 1] = sum;
        }
    }
}

}  // namespace attn

template <class T, int D, int G>
__device__ __forceinline__ void attn_partial(char* smem, const T* q, long long q_s0, long long q_s1,  //
                                             const T* kc, long long k_s0, long long k_s1, long long k_s2,  //
                                             const T* vc, long long v_s0, long long v_s1, long long v_s2,  //
                                             long long L, long long chunk, float scale,                   //
                                             float* part, long long p_s0, long long p_s1, long long c0, long long c1) {
    static_assert(MEGA_WARPS * G * (D + 2) * 4 <= MEGA_SMEM, "attn_partial: warp states do not fit in shared memory");
    const int bytes = (int)sizeof(T);
    const bool vec = q_s1 == 1 && k_s2 == 1 && v_s2 == 1 && aligned16(q) && aligned16(kc) && aligned16(vc) &&
                     ((q_s0 * bytes) & 15) == 0 && ((k_s0 * bytes) & 15) == 0 && ((k_s1 * bytes) & 15) == 0 &&
                     ((v_s0 * bytes) & 15) == 0 && ((v_s1 * bytes) & 15) == 0;
    if (vec)
        attn::partial<T, D, G, true>(smem, q, q_s0, q_s1, kc, k_s0, k_s1, k_s2, vc, v_s0, v_s1, v_s2, L, chunk, scale,
                                     part, p_s0, p_s1, c0, c1);
    else
        attn::partial<T, D, G, false>(smem, q, q_s0, q_s1, kc, k_s0, k_s1, k_s2, vc, v_s0, v_s1, v_s2, L, chunk,
                                      scale, part, p_s0, p_s1, c0, c1);
}

template <class T, int D>
__device__ __forceinline__ void attn_merge(const float* part, long long p_s0, long long p_s1, long long L,
                                           long long chunk, long long Hq, int rows_per, T* out, long long out_s0,
                                           long long out_s1, long long c0) {
    constexpr int DL = cdiv(D, 32);  // output columns per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long nsplit = (L + chunk - 1) / chunk;
    for (int i = warp; i < rows_per; i += MEGA_WARPS) {
        const long long h = c0 * rows_per + i;
        if (h >= Hq) break;
        const float* ph = part + h * p_s0;
        float mx = MEGA_NEG_INF;
        for (long long s = lane; s < nsplit; s += 32) mx = fmaxf(mx, __ldcg(ph + s * p_s1 + D));
        mx = warp_max(mx);
        float num[DL], den = 0.0f;
#pragma unroll
        for (int c = 0; c < DL; ++c) num[c] = 0.0f;
        for (long long s0 = 0; s0 < nsplit; s0 += 32) {
            // lane t weighs split s0 + t; the warp then walks the 32 splits
            const long long s = s0 + lane;
            const float ws = s < nsplit ? exp2f((__ldcg(ph + s * p_s1 + D) - mx) * attn::LOG2E) : 0.0f;
            if (s < nsplit) den += ws * __ldcg(ph + s * p_s1 + D + 1);
            const int n = (int)min_i64(32, nsplit - s0);
#pragma unroll 4
            for (int t = 0; t < n; ++t) {
                const float wt = __shfl_sync(MEGA_FULL_MASK, ws, t);
                const float* row = ph + (s0 + t) * p_s1;
#pragma unroll
                for (int c = 0; c < DL; ++c)
                    if (c * 32 + lane < D) num[c] = fmaf(wt, __ldcg(row + c * 32 + lane), num[c]);
            }
        }
        den = warp_sum(den);
#pragma unroll
        for (int c = 0; c < DL; ++c)
            if (c * 32 + lane < D) out[h * out_s0 + (c * 32 + lane) * out_s1] = from_f32<T>(num[c] / den);
    }
}
