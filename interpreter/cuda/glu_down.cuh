// glu_down: the gated MLP and its down projection in one instance (blockops/glu_down.py).
//   phase 1: h[row0 .. row0+ROWS) = T(T(silu(T(x w^T))) * T(x w2^T)), the gated matvec body
//            (RMSNorm prologue when NORM), written to shared memory instead of global;
//   phase 2: acc[0, :N] += h[tile] @ wd[tile, :], wd the down weight stored transposed
//            ([F, N]): the instance's share is ROWS contiguous rows. Thread t owns 16-byte
//            column vectors t, t + MEGA_THREADS, ... of every row, so no reduction across
//            threads: each thread streams its columns of 16 rows a batch (two batches in
//            flight), then adds its f32 sums (times `scale`: a routed expert's weight, moe.cuh)
//            into acc with 16-byte vector atomics.
// acc_residual: out = T(r + T(acc)), once every glu_down instance has added in.
#pragma once
#include "matvec.cuh"

// acc[0, :N] += scale * this thread's column sums (thread t owns 16-byte column vectors t, t + MEGA_THREADS, ...).
template <class T, int N>
__device__ __forceinline__ void glu_down_add(float* acc, const float (&sum)[cdiv(N / VecN<T>::value, MEGA_THREADS)][VecN<T>::value],
                                             float scale) {
    constexpr int VEC = VecN<T>::value, NV = N / VEC, VPT = cdiv(NV, MEGA_THREADS);
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
        const int vi = v * MEGA_THREADS + threadIdx.x;
        if (vi >= NV) continue;
        float4* p = reinterpret_cast<float4*>(acc + vi * VEC);
#pragma unroll
        for (int e = 0; e < VEC; e += 4)
            atomicAdd(p + e / 4, make_float4(scale * sum[v][e], scale * sum[v][e + 1], scale * sum[v][e + 2], scale * sum[v][e + 3]));
    }
}

template <class T, int K, int N, int ROWS, bool NORM>
__device__ __noinline__ void glu_down(char* smem, Vec<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                      Mat<const T> w2, Mat<const T> wd, float* acc, long long F, long long n_tile,
                                      const MegaWaits wl, float scale) {
    in_global(x, w, w2, wd);  // (not the optional g: an absent view is nullptr)
    constexpr int VEC = VecN<T>::value;
    static_assert(K % VEC == 0 && N % VEC == 0, "glu_down: weight rows must be whole 16-byte vectors");
    static_assert(ROWS * (int)sizeof(T) <= MEGA_SMEM_RESERVED, "glu_down: h tile does not fit the reserved smem");
    constexpr int NV = N / VEC;                        // 16-byte vectors per wd row
    constexpr int VPT = cdiv(NV, MEGA_THREADS);        // vectors per thread per row
    // rows per batch: up to 16 loads a thread, and a divisor of ROWS, so that no batch is half empty
    // (qwen3-0.6b's 24-row tile ran a second batch of 8 rows in 16 slots: perf-notes #58)
    constexpr int RB = divisor_at_most(ROWS, cmax(1, 16 / VPT));
    constexpr int NB = ROWS / RB;                      // batches
    smem = shared_ptr(smem);
    T* hs = reinterpret_cast<T*>(smem + MEGA_SMEM - MEGA_SMEM_RESERVED);  // the top: matvec leaves it alone
    const long long row0 = n_tile * ROWS;
    const int rows = (int)min_i64(ROWS, F - row0);

    // phase 1: the gated matvec (it waits for x itself, after its first weight loads); an x
    // it cannot read as vectors (never the compiler's) takes the generic body
    const Mat<const T> xm{x.p, 0, x.s0};  // x as the matvec body's one row
    const Mat<T> h{hs - row0, 0, 1};
    const bool ok = matvec_impl::stage_vec_ok<T, 1, K, NORM, false>(xm, g, {})
        ? matvec_impl::run_vec_regs<typename matvec_impl::PlanFor<T, 1, K, ROWS, true, NORM>::type, T, 1, K, NORM, true,
                                    false>(smem, xm, g, eps, w, w2, Mat<const T>{}, {}, h, F, n_tile, ROWS, wl)
        : matvec_impl::run_generic<T>(smem, 1, K, ROWS, matvec_impl::FL_GLU | (NORM ? matvec_impl::FL_NORM : 0u), xm, g,
                                      eps, w, w2, Mat<const T>{}, {}, h, F, n_tile, wl, 1);
    if (!ok) return;

    // phase 2. Starting its loads from phase 1's last steps instead measured slower
    // (perf-notes #32: register loads 1.22 ms vs 1.13; plus an L2 prefetch 1.25)
    const int tid = threadIdx.x;
    const T* base = wd.p + row0 * wd.s0;
    uint4 b0[RB][VPT], b1[RB][VPT];
    // rows past a ragged last tile (F % ROWS) re-read its last row (h is 0 there): no zeroing
    auto load = [&](uint4 (&b)[RB][VPT], int j0) {
#pragma unroll
        for (int r = 0; r < RB; ++r)
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                const int vi = v * MEGA_THREADS + tid;
                const long long j = min(j0 + r, rows - 1);
                b[r][v] = NV % MEGA_THREADS == 0 || vi < NV ? ldw16(base + j * wd.s0 + vi * VEC) : make_uint4(0, 0, 0, 0);
            }
    };
    load(b0, 0);
    float sum[VPT][VEC];
#pragma unroll
    for (int v = 0; v < VPT; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) sum[v][e] = 0.0f;
    auto mac = [&](const uint4 (&b)[RB][VPT], int j0) {
#pragma unroll
        for (int r = 0; r < RB; ++r) {
            const float hj = j0 + r < rows ? to_f32(hs[j0 + r]) : 0.0f;
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                float f[VEC];
                unpack16<T>(b[r][v], f);
#pragma unroll
                for (int e = 0; e < VEC; ++e) sum[v][e] = fmaf(f[e], hj, sum[v][e]);
            }
        }
    };
    mega_sync();  // h complete in shared memory
#pragma unroll 1
    for (int bi = 0; bi < NB; bi += 2) {  // b0 holds batch bi
        if (bi + 1 < NB) load(b1, (bi + 1) * RB);
        mac(b0, bi * RB);
        if (bi + 2 < NB) load(b0, (bi + 2) * RB);
        if (bi + 1 < NB) mac(b1, (bi + 1) * RB);
    }
    glu_down_add<T, N>(acc, sum, scale);
}

template <class T>
__device__ __noinline__ void acc_residual(Vec<const T> r, const float* acc, Vec<T> out, long long n, long long tile,
                                          long long c1) {
    in_global(r, out);
    const long long end = min_i64(n, c1 * tile + tile);
    for (long long i = c1 * tile + threadIdx.x; i < end; i += MEGA_THREADS)
        out.p[i * out.s0] = from_f32<T>(round_to<T>(ld_f32(r.p + i * r.s0) + round_to<T>(ld_cg(acc + i))));
}
