// matvec: out[M, N] = x[M, K] @ w[N, K]^T for the ROWS rows [n_tile*ROWS, ...) of w (ragged
// last tile masked). The caller passes x, r and out already advanced to the instance's
// first x row (blockops/matvec.py tiles M by `mrows`, passed as M).
// Fusions (megaegg/blockops/matvec.py is the definition, rounding included):
//   HAS_NORM  x <- T(T(x * rsqrt(mean(x^2) + eps)) * g)   (RMSNorm prologue)
//   HAS_GLU   y <- T(T(silu(T(x w^T))) * T(x w2^T))       (gated pair)
//   HAS_RES   y <- T(r + T(y))                            (residual epilogue)
//
// Batch-1 decode is bound by streaming w, so the body is built around the weight loads:
// - x (M rows, after the norm) is staged once per instance in shared memory, as float
//   when it fits (else as T: exact, every value the dots read is T-representable);
// - each warp owns rows warp, warp + 8, ... of the tile (ragged tiles spread evenly),
//   in groups of RB <= 4 rows; its lanes stride the row in coalesced 16-byte __ldcg
//   loads, U vectors per row per step, so RB * U (* 2 with w2) <= 32 loads in flight per
//   lane (DESIGN.md: 4 rows x 8 loads per lane reached 94% of bandwidth);
// - the first step's weight loads are issued BEFORE x is staged, so the x round trip
//   (and the norm's reductions) hide under the weight latency;
// - fp32 accumulation, warp-shuffle reduction, lanes 0.. write the group's outputs.
// A scalar path (any K, any weight strides: `matmul` reads w through a permute view)
// is correct but slow.
//
// Measured (H200, 1 GiB bf16, persistent one block per SM): 4.0-4.2 TB/s for ROWS >= 32,
// as cuBLAS gemv in the same run; ROWS = 16 (64 KB a tile) ~3.4 TB/s (the tile drains
// before the next starts). Keep MEGA_SMEM <= 128 KB: L1 gets what shared memory leaves,
// and it also stages in-flight ld.global.cg data; at 144-160 KB the gated form drops to
// ~3.55 TB/s. (A cp.async ring into shared memory instead of registers measured no better.)
//
// Shared memory: [red: MEGA_WARPS*M f32][rt: M*ROWS f32 residual tile][xs: M*K of f32 or T]
// [weight ring: D stages of G x MEGA_THREADS x 16 B], all below the top MEGA_SMEM_RESERVED
// bytes (never touched here: matvec_heads keeps its output tile there).
//
// The weight ring: OFF by default (MEGA_MV_RING=0), opt-in for experiments (-DMEGA_MV_RING=bytes).
// Idea: in a model each op gives each SM about one instance; all SMs start together after
// the previous op's barrier and stream in synchronized bursts of 32 vectors per lane (load,
// wait for all, compute), and nothing streams during the barrier hand-off. The ring makes
// each thread stream its weight vectors, in the order the body consumes them, through a
// private ring of D stages of G 16-byte slots in shared memory with cp.async (one commit
// group per stage; a thread reads back only what it copied, so cp.async.wait_group alone
// orders it, no block barrier): it consumes stage t while t+1 .. t+D-1 are in flight and
// refills t's slots with t+D. `matvec_prologue` (emitted by the interpreter BEFORE the
// barrier wait, BlockKind.cuda_prologue) issues the first PRE stages, so the stream runs
// across the hand-off; the body (STAGED = true) issues the rest.
// Measured (H200, llama-3.2-1b decode, context 512, same session): register path 1.499-1.505
// ms/token; ring with the prologue 1.708 (120 KB smem), 1.700 (160 or 200 KB); ring without
// the prologue 1.759; with 32-64 KB of prologue 1.74. In steady state (many instances per SM)
// per-thread 16-byte cp.async streams at ~3.6 TB/s vs 4.19 TB/s for the register path, at
// any ring size: so the ring loses more than the hand-off overlap (~0.05 ms) gains. An
// earlier variant (register path + the first ~100 KB of the tile cp.async'ed before the wait)
// measured 1.955 ms: the LM head slowed 3x (mixing LDGSTS and LDG streams) and the prologue
// bursts slowed the critical path's small ops (matvec_heads +5 us per layer).
// Assumes the interpreter separates instances by a __syncthreads (it must, to release).
#pragma once
#include "common.cuh"

#ifndef MEGA_SMEM_RESERVED
#define MEGA_SMEM_RESERVED 4096  // the top of dynamic shared memory: epilogue tiles (matvec_heads)
#endif
#ifndef MEGA_MV_RING
#define MEGA_MV_RING 0  // most bytes of the weight ring; < 2 stages: the register path (see above: off)
#endif
#ifndef MEGA_MV_PRE
#define MEGA_MV_PRE (1 << 30)  // most ring bytes the prologue issues before the barrier wait
#endif

namespace matvec_impl {

template <class T, int M, int K, int ROWS, bool GLU>
struct Plan {
    static constexpr int VEC = VecN<T>::value;
    static constexpr int KV = K / VEC;                        // 16-byte vectors per row
    static constexpr int RPW = cdiv(ROWS, MEGA_WARPS);        // rows per warp
    static constexpr int NG = cdiv(RPW, 4);                   // row groups per warp
    static constexpr int RB = cdiv(RPW, NG);                  // rows per group (<= 4)
    static constexpr int NW = GLU ? 2 : 1;                    // weight matrices
    static constexpr int VPL = cmax(1, cdiv(KV, 32));         // vectors per lane per row
    static constexpr int U0 = cmin(VPL, cmax(1, 32 / (RB * NW)));
    static constexpr int STEPS = cdiv(VPL, U0);               // steps per row group
    static constexpr int U = cdiv(VPL, STEPS);                // vectors per lane per row per step
    static constexpr int BODY_SMEM = MEGA_SMEM - MEGA_SMEM_RESERVED;  // the top stays untouched
    static constexpr int RED_BYTES = MEGA_WARPS * M * 4;
    static constexpr int RT_BYTES = (M * ROWS * 4 + 15) / 16 * 16;
    static constexpr int HEAD = (RED_BYTES + 15) / 16 * 16 + RT_BYTES;
    static constexpr bool XS_F32 = HEAD + M * K * 4 <= BODY_SMEM;
    using XS = typename Cond<XS_F32, float, T>::type;         // staged x element type
    static_assert(HEAD + M * K * (int)sizeof(XS) <= BODY_SMEM, "matvec: x[M, K] does not fit in shared memory");
    // The weight ring. Each thread's slots (16-byte vectors) of row group gi are consumed in
    // the order j = ((c * RB + rb) * NW + nw), c = s * U + u the column chunk (kv = c * 32 + lane),
    // so consecutive slots share x; stage t holds slots [t * G, t * G + G) of the flat order.
    static constexpr int SPG = STEPS * U * RB * NW;           // slots per row group
    static constexpr int G = SPG % 4 == 0 ? 4 : SPG % 2 == 0 ? 2 : 1;  // slots per stage
    static constexpr int SPGS = SPG / G;                      // stages per row group
    static constexpr int NST = NG * SPGS;                     // stages per instance
    static constexpr int SLOT_BYTES = MEGA_THREADS * 16;
    static constexpr int STAGE_BYTES = G * SLOT_BYTES;
    static constexpr int RING_OFF = (HEAD + M * K * (int)sizeof(XS) + 15) / 16 * 16;
    static constexpr int D = cmax(0, cmin(NST, cmin(BODY_SMEM - RING_OFF, MEGA_MV_RING) / STAGE_BYTES));
    static constexpr bool RING = D >= 2;                      // else the register path
    static constexpr int PRE = RING ? cmin(D, MEGA_MV_PRE / STAGE_BYTES) : 0;  // stages the prologue issues
};

// VEC staged x values at p (16-byte aligned) as floats; n = VecN<T>.
template <int N> __device__ __forceinline__ void xs_load(const float* p, float* f) {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
        const float4 v = *reinterpret_cast<const float4*>(p + e);
        f[e] = v.x; f[e + 1] = v.y; f[e + 2] = v.z; f[e + 3] = v.w;
    }
}
template <int N, class T> __device__ __forceinline__ void xs_load(const T* p, float* f) {
    unpack16<T>(*reinterpret_cast<const uint4*>(p), f);
}
template <int N> __device__ __forceinline__ void xs_store(float* p, const float* f) {
#pragma unroll
    for (int e = 0; e < N; e += 4) *reinterpret_cast<float4*>(p + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
}
template <int N, class T> __device__ __forceinline__ void xs_store(T* p, const float* f) {
    *reinterpret_cast<uint4*>(p) = pack16<T>(f);
}

// Stage x (normalised when NORM) into xs[M][K] and the residual tile into rt[M][ROWS].
// All threads call it; ends with a block barrier.
template <class T, class XS, int M, int K, int ROWS, bool NORM, bool RES>
__device__ __forceinline__ void stage(XS* xs, float* rt, float* red, const T* x, long long x_s0, long long x_s1,
                                      const T* g, long long g_s0, float eps, const T* r, long long r_s0,
                                      long long r_s1, long long row0, long long N) {
    constexpr int VEC = VecN<T>::value, KV = K / VEC, NVX = cdiv(KV, MEGA_THREADS) > 0 ? cdiv(KV, MEGA_THREADS) : 1;  // K < VEC: vec is false, the array just needs a size
    const int tid = threadIdx.x;
    if (RES) {
        for (int j = tid; j < M * ROWS; j += MEGA_THREADS) {
            const long long n = row0 + j % ROWS;
            if (n < N) rt[j] = ld_f32(r + (j / ROWS) * r_s0 + n * r_s1);
        }
    }
    const bool vec = K % VEC == 0 && (M == 1 ? (x_s1 == 1 && aligned16(x)) : vec_rows_ok(x, x_s0, x_s1, K)) &&
                     (!NORM || (g_s0 == 1 && aligned16(g)));
    if (vec) {
        uint4 xr[M][NVX], gr[NORM ? NVX : 1];
#pragma unroll
        for (int i = 0; i < NVX; ++i) {
            const int kv = i * MEGA_THREADS + tid;
            if (kv < KV) {
#pragma unroll
                for (int m = 0; m < M; ++m) xr[m][i] = ldcg16(x + m * x_s0 + kv * VEC);
                if (NORM) gr[i] = ldcg16(g + kv * VEC);
            }
        }
        float rinv[M];
        if (NORM) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                rinv[m] = 0.0f;
#pragma unroll
                for (int i = 0; i < NVX; ++i) {
                    if (i * MEGA_THREADS + tid < KV) {
                        float f[VEC];
                        unpack16<T>(xr[m][i], f);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) rinv[m] += f[e] * f[e];
                    }
                }
            }
            block_reduce_sum_n<M>(rinv, red);
#pragma unroll
            for (int m = 0; m < M; ++m) rinv[m] = 1.0f / sqrtf(rinv[m] / (float)K + eps);
        }
#pragma unroll
        for (int i = 0; i < NVX; ++i) {
            const int kv = i * MEGA_THREADS + tid;
            if (kv >= KV) continue;
            float gf[VEC];
            if (NORM) unpack16<T>(gr[i], gf);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float f[VEC];
                unpack16<T>(xr[m][i], f);
                if (NORM) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) f[e] = round_to<T>(round_to<T>(f[e] * rinv[m]) * gf[e]);
                }
                xs_store<VEC>(xs + m * K + kv * VEC, f);
            }
        }
    } else {
        float ss[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            ss[m] = 0.0f;
            for (int k = tid; k < K; k += MEGA_THREADS) {
                const float v = ld_f32(x + m * x_s0 + k * x_s1);
                ss[m] += v * v;
                xs[m * K + k] = from_f32<XS>(v);  // exact: x is T
            }
        }
        if (NORM) {
            block_reduce_sum_n<M>(ss, red);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float rinv = 1.0f / sqrtf(ss[m] / (float)K + eps);
                for (int k = tid; k < K; k += MEGA_THREADS) {  // the same thread's elements: no barrier
                    const float v = round_to<T>(to_f32(xs[m * K + k]) * rinv);
                    xs[m * K + k] = from_f32<XS>(round_to<T>(v * ld_f32(g + k * g_s0)));
                }
            }
        }
    }
    __syncthreads();
}

// The fused epilogue for output element (m, n) of tile-local row `local`.
template <class T, int ROWS, bool GLU, bool RES>
__device__ __forceinline__ void finish(float dot, float dot2, const float* rt, int m, int local, long long n, T* out,
                                       long long out_s0, long long out_s1) {
    float y = round_to<T>(dot);
    if (GLU) y = round_to<T>(round_to<T>(silu_f32(y)) * round_to<T>(dot2));
    if (RES) y = round_to<T>(rt[m * ROWS + local] + y);
    out[m * out_s0 + n * out_s1] = from_f32<T>(y);
}

// Issue the 16-byte weight loads of step s of row group gi into wa (and wb).
template <class P, class T, int ROWS, bool GLU>
__device__ __forceinline__ void load_step(uint4 (&wa)[P::RB][P::U], uint4 (&wb)[GLU ? P::RB : 1][GLU ? P::U : 1],
                                          const T* w, long long w_s0, const T* w2, long long w2_s0, long long row0,
                                          long long N, int gi, int s, int warp, int lane) {
#pragma unroll
    for (int rb = 0; rb < P::RB; ++rb) {
        const int local = (gi * P::RB + rb) * MEGA_WARPS + warp;
        const long long n = row0 + local;
        const bool ok = local < ROWS && n < N;
        const T* wr = w + n * w_s0;
        const T* wr2 = GLU ? w2 + n * w2_s0 : nullptr;
#pragma unroll
        for (int u = 0; u < P::U; ++u) {
            const int kv = (s * P::U + u) * 32 + lane;
            const bool in = ok && kv < P::KV;
            wa[rb][u] = in ? ldcg16(wr + kv * P::VEC) : make_uint4(0, 0, 0, 0);
            if (GLU) wb[GLU ? rb : 0][GLU ? u : 0] = in ? ldcg16(wr2 + kv * P::VEC) : make_uint4(0, 0, 0, 0);
        }
    }
}

// Slot j of row group gi of the ring order: its column chunk c, row rb of the group, matrix nw.
template <class P> struct Slot {
    int c, rb, nw;
    __device__ __forceinline__ Slot(int j) : c(j / (P::RB * P::NW)), rb(j / P::NW % P::RB), nw(j % P::NW) {}
};

// Issue stage t (stages gi * SPGS + js: gi runtime, js usually a constant) of this thread's
// slots into ring position t % D with cp.async. Out-of-tile slots are not copied (the body
// reads zeros for them). The caller commits.
template <class P, class T, int ROWS, bool GLU>
__device__ __forceinline__ void ring_issue(char* ring, const T* w, long long w_s0, const T* w2, long long w2_s0,
                                           long long row0, long long N, int gi, int js, int warp, int lane) {
    const int pos = (gi * P::SPGS + js) % P::D;
#pragma unroll
    for (int q = 0; q < P::G; ++q) {
        const Slot<P> sl(js * P::G + q);
        const int local = (gi * P::RB + sl.rb) * MEGA_WARPS + warp;
        const long long n = row0 + local;
        const int kv = sl.c * 32 + lane;
        if (local < ROWS && n < N && kv < P::KV)
            cp_async16(ring + (pos * P::G + q) * P::SLOT_BYTES,
                       (GLU && sl.nw ? w2 + n * w2_s0 : w + n * w_s0) + kv * P::VEC, 16);
    }
}

// Issue stages [t0, t1) of the instance (constants), one commit group each.
template <class P, class T, int ROWS, bool GLU, int T0, int T1>
__device__ __forceinline__ void ring_fill(char* ring, const T* w, long long w_s0, const T* w2, long long w2_s0,
                                          long long row0, long long N, int warp, int lane) {
#pragma unroll
    for (int t = T0; t < T1; ++t) {
        ring_issue<P, T, ROWS, GLU>(ring, w, w_s0, w2, w2_s0, row0, N, t / P::SPGS, t % P::SPGS, warp, lane);
        cp_async_commit();
    }
}

template <class T, int M, int K, int ROWS, bool NORM, bool GLU, bool RES>
__device__ __forceinline__ void run_vec_regs(char* smem, const T* x, long long x_s0, long long x_s1, const T* g,
                                        long long g_s0, float eps, const T* w, long long w_s0, const T* w2,
                                        long long w2_s0, const T* r, long long r_s0, long long r_s1, T* out,
                                        long long out_s0, long long out_s1, long long N, long long n_tile) {
    using P = Plan<T, M, K, ROWS, GLU>;
    using XS = typename P::XS;
    float* red = reinterpret_cast<float*>(smem);
    float* rt = reinterpret_cast<float*>(smem + (P::RED_BYTES + 15) / 16 * 16);
    XS* xs = reinterpret_cast<XS*>(smem + P::HEAD);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = n_tile * ROWS;

    uint4 wa[P::RB][P::U];
    uint4 wb[GLU ? P::RB : 1][GLU ? P::U : 1];
    load_step<P, T, ROWS, GLU>(wa, wb, w, w_s0, w2, w2_s0, row0, N, 0, 0, warp, lane);  // in flight while x stages
    stage<T, XS, M, K, ROWS, NORM, RES>(xs, rt, red, x, x_s0, x_s1, g, g_s0, eps, r, r_s0, r_s1, row0, N);

#pragma unroll 1
    for (int gi = 0; gi < P::NG; ++gi) {
        float acc[P::RB][M], acc2[GLU ? P::RB : 1][M];
#pragma unroll
        for (int rb = 0; rb < P::RB; ++rb)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[rb][m] = 0.0f, acc2[GLU ? rb : 0][m] = 0.0f;
#pragma unroll 1
        for (int s = 0; s < P::STEPS; ++s) {
            if (gi | s) load_step<P, T, ROWS, GLU>(wa, wb, w, w_s0, w2, w2_s0, row0, N, gi, s, warp, lane);
#pragma unroll
            for (int u = 0; u < P::U; ++u) {
                const int kv = (s * P::U + u) * 32 + lane;
                if (P::KV % (32 * P::U * P::STEPS) != 0 && kv >= P::KV) continue;
                float xf[M][P::VEC];
#pragma unroll
                for (int m = 0; m < M; ++m) xs_load<P::VEC>(xs + m * K + kv * P::VEC, xf[m]);
#pragma unroll
                for (int rb = 0; rb < P::RB; ++rb) {
                    float wf[P::VEC];
                    unpack16<T>(wa[rb][u], wf);
#pragma unroll
                    for (int m = 0; m < M; ++m)
#pragma unroll
                        for (int e = 0; e < P::VEC; ++e) acc[rb][m] = fmaf(wf[e], xf[m][e], acc[rb][m]);
                    if (GLU) {
                        unpack16<T>(wb[GLU ? rb : 0][GLU ? u : 0], wf);
#pragma unroll
                        for (int m = 0; m < M; ++m)
#pragma unroll
                            for (int e = 0; e < P::VEC; ++e)
                                acc2[GLU ? rb : 0][m] = fmaf(wf[e], xf[m][e], acc2[GLU ? rb : 0][m]);
                    }
                }
            }
        }
#pragma unroll
        for (int rb = 0; rb < P::RB; ++rb) {
            const int local = (gi * P::RB + rb) * MEGA_WARPS + warp;
            const long long n = row0 + local;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float d = warp_sum(acc[rb][m]);
                const float d2 = GLU ? warp_sum(acc2[GLU ? rb : 0][m]) : 0.0f;
                if (lane == (rb * M + m) % 32 && local < ROWS && n < N)
                    finish<T, ROWS, GLU, RES>(d, d2, rt, m, local, n, out, out_s0, out_s1);
            }
        }
    }
}

// The ring path (P::RING). STAGED: matvec_prologue issued stages [0, PRE) already.
template <class T, int M, int K, int ROWS, bool NORM, bool GLU, bool RES, bool STAGED>
__device__ __forceinline__ void run_vec_ring(char* smem, const T* x, long long x_s0, long long x_s1, const T* g,
                                             long long g_s0, float eps, const T* w, long long w_s0, const T* w2,
                                             long long w2_s0, const T* r, long long r_s0, long long r_s1, T* out,
                                             long long out_s0, long long out_s1, long long N, long long n_tile) {
    using P = Plan<T, M, K, ROWS, GLU>;
    using XS = typename P::XS;
    float* red = reinterpret_cast<float*>(smem);
    float* rt = reinterpret_cast<float*>(smem + (P::RED_BYTES + 15) / 16 * 16);
    XS* xs = reinterpret_cast<XS*>(smem + P::HEAD);
    char* ring = smem + P::RING_OFF + threadIdx.x * 16;  // this thread's slots
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = n_tile * ROWS;

    // D stages in flight (commit groups), then x staged under their latency
    ring_fill<P, T, ROWS, GLU, STAGED ? P::PRE : 0, P::D>(ring, w, w_s0, w2, w2_s0, row0, N, warp, lane);
    stage<T, XS, M, K, ROWS, NORM, RES>(xs, rt, red, x, x_s0, x_s1, g, g_s0, eps, r, r_s0, r_s1, row0, N);

#pragma unroll 1
    for (int gi = 0; gi < P::NG; ++gi) {
        float acc[P::RB][M], acc2[GLU ? P::RB : 1][M];
#pragma unroll
        for (int rb = 0; rb < P::RB; ++rb)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[rb][m] = 0.0f, acc2[GLU ? rb : 0][m] = 0.0f;
#pragma unroll
        for (int js = 0; js < P::SPGS; ++js) {
            cp_async_wait<P::D - 1>();  // stage gi * SPGS + js has landed (one group per stage)
            const int pos = (gi * P::SPGS + js) % P::D;
            uint4 v[P::G];
#pragma unroll
            for (int q = 0; q < P::G; ++q) {
                const Slot<P> sl(js * P::G + q);
                const int local = (gi * P::RB + sl.rb) * MEGA_WARPS + warp;
                const bool in = local < ROWS && row0 + local < N && sl.c * 32 + lane < P::KV;
                v[q] = in ? *reinterpret_cast<const uint4*>(ring + (pos * P::G + q) * P::SLOT_BYTES)
                          : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int q = 0; q < P::G; ++q) {
                const Slot<P> sl(js * P::G + q);
                const int kv = sl.c * 32 + lane;
                if (P::KV % 32 != 0 && kv >= P::KV) continue;
                float xf[M][P::VEC], wf[P::VEC];
#pragma unroll
                for (int m = 0; m < M; ++m) xs_load<P::VEC>(xs + m * K + kv * P::VEC, xf[m]);
                unpack16<T>(v[q], wf);
                float(&a)[M] = GLU && sl.nw ? acc2[GLU ? sl.rb : 0] : acc[sl.rb];
#pragma unroll
                for (int m = 0; m < M; ++m)
#pragma unroll
                    for (int e = 0; e < P::VEC; ++e) a[m] = fmaf(wf[e], xf[m][e], a[m]);
            }
            // refill this position with stage t + D (its values are consumed above); always
            // commit, so that "D - 1 groups pending" keeps meaning "the next stage landed"
            const int nt = gi * P::SPGS + js + P::D;
            if (nt < P::NST)
                ring_issue<P, T, ROWS, GLU>(ring, w, w_s0, w2, w2_s0, row0, N, gi + (js + P::D) / P::SPGS,
                                            (js + P::D) % P::SPGS, warp, lane);
            cp_async_commit();
        }
#pragma unroll
        for (int rb = 0; rb < P::RB; ++rb) {
            const int local = (gi * P::RB + rb) * MEGA_WARPS + warp;
            const long long n = row0 + local;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float d = warp_sum(acc[rb][m]);
                const float d2 = GLU ? warp_sum(acc2[GLU ? rb : 0][m]) : 0.0f;
                if (lane == (rb * M + m) % 32 && local < ROWS && n < N)
                    finish<T, ROWS, GLU, RES>(d, d2, rt, m, local, n, out, out_s0, out_s1);
            }
        }
    }
    cp_async_wait<0>();  // (only empty groups remain)
}

template <class T, int M, int K, int ROWS, bool NORM, bool GLU, bool RES>
__device__ __forceinline__ void run_scalar(char* smem, const T* x, long long x_s0, long long x_s1, const T* g,
                                           long long g_s0, float eps, const T* w, long long w_s0, long long w_s1,
                                           const T* w2, long long w2_s0, long long w2_s1, const T* r, long long r_s0,
                                           long long r_s1, T* out, long long out_s0, long long out_s1, long long N,
                                           long long n_tile) {
    using P = Plan<T, M, K, ROWS, GLU>;
    using XS = typename P::XS;
    float* red = reinterpret_cast<float*>(smem);
    float* rt = reinterpret_cast<float*>(smem + (P::RED_BYTES + 15) / 16 * 16);
    XS* xs = reinterpret_cast<XS*>(smem + P::HEAD);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = n_tile * ROWS;
    stage<T, XS, M, K, ROWS, NORM, RES>(xs, rt, red, x, x_s0, x_s1, g, g_s0, eps, r, r_s0, r_s1, row0, N);
#pragma unroll 1
    for (int local = warp; local < ROWS; local += MEGA_WARPS) {
        const long long n = row0 + local;
        if (n >= N) break;
        float acc[M], acc2[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.0f, acc2[m] = 0.0f;
        const T* wr = w + n * w_s0;
        const T* wr2 = GLU ? w2 + n * w2_s0 : nullptr;
#pragma unroll 4
        for (int k = lane; k < K; k += 32) {
            const float wv = ld_f32(wr + k * w_s1);
            const float wv2 = GLU ? ld_f32(wr2 + k * w2_s1) : 0.0f;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float xv = to_f32(xs[m * K + k]);
                acc[m] = fmaf(wv, xv, acc[m]);
                if (GLU) acc2[m] = fmaf(wv2, xv, acc2[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float d = warp_sum(acc[m]);
            const float d2 = GLU ? warp_sum(acc2[m]) : 0.0f;
            if (lane == m % 32) finish<T, ROWS, GLU, RES>(d, d2, rt, m, local, n, out, out_s0, out_s1);
        }
    }
}

}  // namespace matvec_impl

// The prologue (emitted by the interpreter BEFORE the instance's barrier wait, all threads):
// issue the first PRE stages of the weight ring (needs no input), so the weight stream
// continues across the barrier hand-off. The body must follow with STAGED = true and the
// same operands, with no other use of shared memory in between. Issues nothing off the
// vector path (the body decides the same way) or when the ring is off (PRE = 0).
namespace matvec_impl {
template <class T, int M, int K, int ROWS, bool HAS_GLU>
__device__ __noinline__ void ring_prologue(char* smem, const T* w, long long w_s0, long long w_s1, const T* w2,
                                           long long w2_s0, long long w2_s1, long long N, long long n_tile) {
    using P = Plan<T, M, K, ROWS, HAS_GLU>;
    bool vec = vec_rows_ok(w, w_s0, w_s1, K);
    if (HAS_GLU) vec = vec && vec_rows_ok(w2, w2_s0, w2_s1, K);
    if (!vec) return;
    char* ring = shared_ptr(smem) + P::RING_OFF + threadIdx.x * 16;
    ring_fill<P, T, ROWS, HAS_GLU, 0, P::PRE>(ring, w, w_s0, w2, w2_s0, n_tile * ROWS, N, threadIdx.x >> 5,
                                              threadIdx.x & 31);
}
}  // namespace matvec_impl

template <class T, int M, int K, int ROWS, bool HAS_GLU>
__device__ __forceinline__ void matvec_prologue(char* smem, const T* w, long long w_s0, long long w_s1, const T* w2,
                                                long long w2_s0, long long w2_s1, long long N, long long n_tile) {
    if constexpr (K % VecN<T>::value == 0 && matvec_impl::Plan<T, M, K, ROWS, HAS_GLU>::PRE > 0)
        matvec_impl::ring_prologue<T, M, K, ROWS, HAS_GLU>(smem, w, w_s0, w_s1, w2, w2_s0, w2_s1, N, n_tile);
}

// One instance: rows [n_tile*ROWS, min(n_tile*ROWS + ROWS, N)) of out[M, N]. Absent operands
// (g, w2, r) are nullptr with zero strides. STAGED: matvec_prologue ran just before (with the
// same template arguments and operands); else the body streams everything itself.
template <class T, int M, int K, int ROWS, bool HAS_NORM, bool HAS_GLU, bool HAS_RES, bool STAGED = false>
__device__ __noinline__ void matvec(char* smem, const T* x, long long x_s0, long long x_s1,  //
                                    const T* g, long long g_s0, float eps,                    //
                                    const T* w, long long w_s0, long long w_s1,               //
                                    const T* w2, long long w2_s0, long long w2_s1,            //
                                    const T* r, long long r_s0, long long r_s1,               //
                                    T* out, long long out_s0, long long out_s1, long long N, long long n_tile) {
    static_assert(M >= 1 && K >= 1 && ROWS >= 1, "matvec: bad shape");
    smem = shared_ptr(smem);
    bool vec = K % VecN<T>::value == 0 && vec_rows_ok(w, w_s0, w_s1, K);
    if (HAS_GLU) vec = vec && vec_rows_ok(w2, w2_s0, w2_s1, K);
    if constexpr (K % VecN<T>::value == 0) {
        if (vec) {
            if constexpr (matvec_impl::Plan<T, M, K, ROWS, HAS_GLU>::RING)
                matvec_impl::run_vec_ring<T, M, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES, STAGED>(
                    smem, x, x_s0, x_s1, g, g_s0, eps, w, w_s0, w2, w2_s0, r, r_s0, r_s1, out, out_s0, out_s1, N, n_tile);
            else
                matvec_impl::run_vec_regs<T, M, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES>(
                    smem, x, x_s0, x_s1, g, g_s0, eps, w, w_s0, w2, w2_s0, r, r_s0, r_s1, out, out_s0, out_s1, N, n_tile);
            return;
        }
    }
    matvec_impl::run_scalar<T, M, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES>(
        smem, x, x_s0, x_s1, g, g_s0, eps, w, w_s0, w_s1, w2, w2_s0, w2_s1, r, r_s0, r_s1, out, out_s0, out_s1, N, n_tile);
}
