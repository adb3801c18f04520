// rope_rows: rotate-half rotary embedding of rows [c0*rows_per, min(c0*rows_per + rows_per,
// rows)) of x[rows, D] (blockops/rope.py). Row r sits at position pos_ids[(r / group) *
// pos_s0] when pos_ids is given, else at `pos`. angle = float(position) * inv_freq[j]
// (f32), accurate sincosf, and the products and sums rounded one by one (no FMA
// contraction) as torch evaluates x1*cos - x2*sin and x2*cos + x1*sin.
// One thread per (row, j < D/2) pair; in place (out == x) is safe.
#pragma once
#include "common.cuh"

template <class T, int D>
__device__ __noinline__ void rope_rows(const T* x, long long x_s0, long long x_s1, const float* inv_freq,
                                          const int* pos_ids, long long pos_s0, long long pos, long long group,
                                          T* out, long long out_s0, long long out_s1, long long rows, int rows_per,
                                          long long c0) {
    static_assert(D % 2 == 0, "rope: head dim must be even");
    constexpr int H = D / 2;
    const long long r0 = c0 * rows_per, r1 = min_i64(r0 + rows_per, rows);
    const int n = (int)max_i64(0, r1 - r0) * H;
    for (int i = threadIdx.x; i < n; i += MEGA_THREADS) {
        const long long r = r0 + i / H;
        const int j = i % H;
        const long long p = pos_ids ? (long long)ld_cg(pos_ids + (r / group) * pos_s0) : pos;
        const float ang = __fmul_rn((float)p, ld_cg(inv_freq + j));
        float sn, cs;
        sincosf(ang, &sn, &cs);
        const float x1 = ld_f32(x + r * x_s0 + j * x_s1), x2 = ld_f32(x + r * x_s0 + (j + H) * x_s1);
        out[r * out_s0 + j * out_s1] = from_f32<T>(__fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)));
        out[r * out_s0 + (j + H) * out_s1] = from_f32<T>(__fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
    }
}
