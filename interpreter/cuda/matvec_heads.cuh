// matvec_heads (megaegg/blockops/matvec_heads.py is the definition): the matvec body
// computes this instance's ROWS rows into a shared-memory tile (the top 4 KB of dynamic
// shared memory, reserved for epilogues), then each row is RoPE-rotated within its head
// and stored to out[head, d] (the q buffer or a KV cache row), rounded as rope.cuh's rope_rotate does
// (HF: as Hugging Face's apply_rotary_pos_emb).
#pragma once
#include "common.cuh"
#include "matvec_tile.cuh"
#include "rope.cuh"

template <class T, int K, int ROWS, int D, bool HAS_NORM, bool ROPE, bool HF = false>
__device__ __noinline__ void matvec_heads(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                          const float* inv_freq, long long pos, Mat<T> out, long long N,
                                          long long n_tile) {
    in_global(x, w, out);  // (not the optional g: an absent view is nullptr)
    static_assert(ROWS % D == 0 && D % 2 == 0, "matvec_heads: whole, even heads per instance");
    const T* tile = matvec_to_tile<T, K, ROWS, HAS_NORM>(smem, x, g, eps, w, N, n_tile);
    const long long n0 = n_tile * ROWS;
    const int nrows = (int)min_i64(ROWS, N - n0);
    constexpr int HALF = D / 2;
    for (int i = threadIdx.x; i < nrows; i += MEGA_THREADS) {
        const long long n = n0 + i;
        const int d = (int)(n % D);
        float v = to_f32(tile[i]);
        if (ROPE) {
            float s, c;
            sincosf(__fmul_rn((float)pos, ld_cg(inv_freq + d % HALF)), &s, &c);
            const float partner = to_f32(tile[d < HALF ? i + HALF : i - HALF]);
            v = d < HALF ? rope_rotate<T, HF>(v, partner, s, c).x : rope_rotate<T, HF>(partner, v, s, c).y;
        }
        out.p[(n / D) * out.s0 + d * out.s1] = from_f32<T>(v);
    }
    mega_sync();  // the tile is reused by the next instance
}
