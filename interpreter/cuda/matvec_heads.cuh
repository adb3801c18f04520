// matvec_heads (megaegg/blockops/matvec_heads.py is the definition): the matvec body
// computes this instance's ROWS rows into a shared-memory tile (the top 4 KB of dynamic
// shared memory, reserved for epilogues), then each row is RoPE-rotated within its head
// and stored to out[head * out_s0 + d * out_s1] (the q buffer or a KV cache row).
#pragma once
#include "common.cuh"
#include "matvec_tile.cuh"

template <class T, int K, int ROWS, int D, bool HAS_NORM, bool ROPE>
__device__ __noinline__ void matvec_heads(char* smem, const T* x, long long x_s0, long long x_s1,  //
                                          const T* g, long long g_s0, float eps,                    //
                                          const T* w, long long w_s0, long long w_s1,               //
                                          const float* inv_freq, long long pos,                      //
                                          T* out, long long out_s0, long long out_s1, long long N, long long n_tile) {
    static_assert(ROWS % D == 0 && D % 2 == 0, "matvec_heads: whole, even heads per instance");
    const T* tile = matvec_to_tile<T, K, ROWS, HAS_NORM>(smem, x, x_s0, x_s1, g, g_s0, eps, w, w_s0, w_s1, N, n_tile);
    const long long n0 = n_tile * ROWS;
    const int nrows = (int)min_i64(ROWS, N - n0);
    constexpr int HALF = D / 2;
    for (int i = threadIdx.x; i < nrows; i += MEGA_THREADS) {
        const long long n = n0 + i;
        const int d = (int)(n % D);
        float v = to_f32(tile[i]);
        if (ROPE) {
            float s, c;
            sincosf((float)pos * ld_cg(inv_freq + d % HALF), &s, &c);
            const float partner = to_f32(tile[d < HALF ? i + HALF : i - HALF]);
            v = d < HALF ? v * c - partner * s : v * c + partner * s;
        }
        out[(n / D) * out_s0 + d * out_s1] = from_f32<T>(v);
    }
    mega_sync();  // the tile is reused by the next instance
}
