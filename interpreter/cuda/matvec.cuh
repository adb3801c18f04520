// matvec: out[M, N] = x[M, K] @ w[N, K]^T for the ROWS rows [n_tile*ROWS, ...) of w (ragged
// last tile masked). The caller passes x, r and out already advanced to the instance's
// first x row (blockops/matvec.py tiles M by `mrows`, passed as M).
// Fusions (megaegg/blockops/matvec.py is the definition, rounding included):
//   HAS_NORM  x <- T(T(x * rsqrt(mean(x^2) + eps)) * g)   (RMSNorm prologue)
//   HAS_GLU   y <- T(T(silu(T(x w^T))) * T(x w2^T))       (gated pair)
//   HAS_RES   y <- T(r + T(y))                            (residual epilogue)
//   SUMS      x <- T(x + T(xa)), r <- T(r + T(ra)) where xa / ra is given (f32 glu_down sums,
//             read as staged: the reader does acc_residual's work, perf-notes #34). Whether
//             they are given is a runtime choice: layer 0 (no sums) shares the other layers' code.
//
// Batch-1 decode is bound by streaming w, so the body is built around the weight loads:
// - x (M rows, after the norm) is staged once per instance in shared memory, as float
//   when it fits (else as T: exact, every value the dots read is T-representable);
// - each warp owns rows warp, warp + 8, ... of the tile (ragged tiles spread evenly),
//   in groups of RB <= 4 rows; its lanes stride the row in coalesced 16-byte ldw16
//   loads, U vectors per row per step, so RB * U (* 2 with w2) <= 32 loads in flight per
//   lane (docs/design.md: 4 rows x 8 loads per lane reached 94% of bandwidth); tiles of up to
//   512 KB instead alternate two register buffers of 16 loads (Plan::PIPE), so the next
//   step's loads are in flight while a step computes and while x stages after the wait;
// - the first step's weight loads are issued BEFORE x is staged, so the x round trip
//   (and the norm's reductions) hide under the weight latency;
// A generic path (run_generic: any K, any strides; `matmul` reads w through a permute view)
// is correct but slow.
//
// Measured (H200, 1 GiB bf16, persistent one block per SM): 4.0-4.2 TB/s for ROWS >= 32,
// as cuBLAS gemv in the same run; ROWS = 16 (64 KB a tile) ~3.4 TB/s (the tile drains
// before the next starts). Keep MEGA_SMEM <= 128 KB: L1 gets what shared memory leaves,
// and it also stages in-flight ld.global.cg data; at 144-160 KB the gated form drops to
// ~3.55 TB/s.
//
// - the body waits for its inputs itself (BlockKind.waits_in_body): the first step's weight
//   loads are issued before the wait, so up to 128 KB per SM stream in during the hand-off;
// - fp32 accumulation, warp-shuffle reduction, lanes 0.. write the group's outputs.
//
// Shared memory: [red: MEGA_WARPS*M f32][xs: M*K of f32 or T][rt: M*ROWS f32 residual tile],
// all below the top MEGA_SMEM_RESERVED bytes (never touched here: matvec_to_tile's output).
// Tried and dropped for one x row (docs/perf-notes.md #7, #10): a per-thread cp.async ring and a TMA
// bulk-copy ring into shared memory, both slower than loads into registers. (Many x rows: the wide tile,
// matvec_wide.cuh, rings both operands through shared memory.)
// Assumes the interpreter separates instances by a mega_sync (it must, to release).
#pragma once
#include "common.cuh"

#define MEGA_SMEM_RESERVED 4096  // the top of dynamic shared memory: epilogue tiles (matvec_heads)
#define MEGA_WIDE_M 64  // x rows of a runtime M's wide tile (matvec_wide.cuh)


namespace matvec_impl {

// The f32 sums added to x and r as they are read (when the body takes SUMS: a runtime choice, so
// the layers with and without them share one instantiation); absent: nullptr.
struct Sums {
    Mat<const float> x, r;
};

// The code shape of the register body (run_vec_regs): everything that changes its instructions.
// The tile height is a runtime value, so tiles of different heights with the same shape share one
// body (PlanFor picks the shape).
template <class T, int M, int K, int RB_, bool PIPE_, bool XS_F32, bool GLU>
struct Plan {
    static constexpr int VEC = VecN<T>::value;
    static constexpr int KV = K / VEC;                        // 16-byte vectors per row
    static constexpr int RB = RB_;                            // row slots a group
    static constexpr int NW = GLU ? 2 : 1;                    // weight matrices
    static constexpr int VPL = cmax(1, cdiv(KV, 32));         // vectors per lane per row
    static constexpr bool PIPE = PIPE_;
    static constexpr int LOADS = PIPE || M >= 4 ? 16 : 32;   // 16-byte loads per lane per step (a buffer)
    static constexpr int U0 = cmin(VPL, cmax(1, LOADS / (RB * NW)));
    static constexpr int STEPS = cdiv(VPL, U0);               // steps per row group
    static constexpr int U = cdiv(VPL, STEPS);                // vectors per lane per row per step
    static constexpr int RED_BYTES = (MEGA_WARPS * M * 4 + 15) / 16 * 16;
    using XS = typename Cond<XS_F32, float, T>::type;         // staged x element type
    static constexpr int XS_BYTES = (M * K * (int)sizeof(XS) + 15) / 16 * 16;
    // shared memory: [red: MEGA_WARPS*M f32][xs: M*K of XS][rt: M*rows f32 residual tile]
    __device__ static float* red(char* smem) { return reinterpret_cast<float*>(smem); }
    __device__ static XS* xs(char* smem) { return reinterpret_cast<XS*>(smem + RED_BYTES); }
    __device__ static float* rt(char* smem) { return reinterpret_cast<float*>(smem + RED_BYTES + XS_BYTES); }
};

// The Plan a tile of ROWS rows takes: each warp owns rows warp, warp + 8, ... of the tile (Rows),
// in the fewest groups of at most RG row slots, spread evenly. Tiles whose shapes agree (e.g. 32
// and 128 rows of the same K and fusions) run one body.
template <class T, int M, int K, int ROWS, bool GLU, bool NORM>
struct PlanFor {
    static constexpr int RPW = cdiv(ROWS, MEGA_WARPS);        // rows per warp
    static constexpr int RG = M >= 4 ? 2 : 4;                 // rows a group at most (M >= 4: M accumulators a row)
    static constexpr int NG = cdiv(RPW, RG);                  // row groups per warp
    static constexpr int RB = cdiv(RPW, NG);                  // rows per group (<= RG)
    // Pipelined (two register buffers of 16 loads a lane: the next step's loads are in flight
    // while a step computes and while x stages after the wait) where staging x is long, a
    // norm prologue's block reduction or x of >= 16 KB, and the tile is <= 512 KB. Elsewhere
    // 32 loads a lane in flight streamed better (perf-notes #26: pipelining every tile gave
    // llama-3.2-1b -4%, qwen3-8b +1.5-2%, from its 256 KB O and its 768 KB-1.5 MB tiles).
    // Several x rows (M >= 4: a batch, a prompt) make each weight vector M times the arithmetic and
    // need M times the accumulators: one buffer of 16 loads a lane, so nothing spills.
    static constexpr long long TILE_BYTES = (long long)ROWS * K * (GLU ? 2 : 1) * (long long)sizeof(T);
    static constexpr bool PIPE = M < 4 && TILE_BYTES <= 512 * 1024 && (NORM || K * (int)sizeof(T) >= 16384);
    static constexpr int BODY_SMEM = MEGA_SMEM - MEGA_SMEM_RESERVED;  // the top stays untouched
    static constexpr int HEAD = (MEGA_WARPS * M * 4 + 15) / 16 * 16 + (M * ROWS * 4 + 15) / 16 * 16;
    static constexpr bool XS_F32 = HEAD + M * K * 4 <= BODY_SMEM;
    static_assert(K % VecN<T>::value != 0 || HEAD + M * K * (XS_F32 ? 4 : (int)sizeof(T)) <= BODY_SMEM,
                  "matvec: x[M, K] does not fit in shared memory");  // (K % VEC != 0: the generic body)
    using type = Plan<T, M, K, RB, PIPE, XS_F32, GLU>;
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


// Whether stage() can read x (and g, and the x sums) as 16-byte vectors; else the caller takes
// run_generic.
template <class T, int M, int K, bool NORM, bool SUMS>
__device__ __forceinline__ bool stage_vec_ok(Mat<const T> x, Vec<const T> g, const Sums& sums) {
    return K % VecN<T>::value == 0 && (M == 1 ? (x.s1 == 1 && aligned16(x.p)) : vec_rows_ok(x.p, x.s0, x.s1, K)) &&
           (!NORM || (g.s0 == 1 && aligned16(g.p))) &&
           (!(SUMS && sums.x.p) || (sums.x.s1 == 1 && aligned16(sums.x.p) && (M == 1 || sums.x.s0 % 4 == 0)));
}

// Stage x (normalised when NORM) into xs[M][K] and the residual tile into rt[M][rows]; x as
// stage_vec_ok checked. All threads call it; ends with a block barrier.
template <class T, class XS, int M, int K, bool NORM, bool RES, bool SUMS>
__device__ __forceinline__ void stage(XS* xs, float* rt, float* red, Mat<const T> x, Vec<const T> g, float eps,
                                      Mat<const T> r, const Sums& sums, long long row0, int rows, long long N, int mv = M) {
    constexpr int VEC = VecN<T>::value, KV = K / VEC, NVX = cdiv(KV, MEGA_THREADS) > 0 ? cdiv(KV, MEGA_THREADS) : 1;  // (K < VEC: not run, the array needs a size)
    const int tid = threadIdx.x;
    const bool xacc = SUMS && sums.x.p, racc = SUMS && sums.r.p;
    if (RES) {
        for (int m = 0; m < mv; ++m)
            for (int j = tid; j < rows; j += MEGA_THREADS) {
                const long long n = row0 + j;
                if (n < N) {
                    float v = ld_f32(r.p + m * r.s0 + n * r.s1);
                    if (racc) v = round_to<T>(v + round_to<T>(ld_cg(sums.r.p + m * sums.r.s0 + n * sums.r.s1)));
                    rt[m * rows + j] = v;
                }
            }
    }
    if constexpr (K % VEC == 0) {
        constexpr int AV = SUMS ? VEC / 4 : 1;  // 16-byte f32 vectors of the sum per x vector
        uint4 xr[M][NVX], gr[NORM ? NVX : 1], ar[SUMS ? M : 1][SUMS ? NVX : 1][AV];
#pragma unroll
        for (int i = 0; i < NVX; ++i) {
            const int kv = i * MEGA_THREADS + tid;
            if (kv < KV) {
#pragma unroll
                for (int m = 0; m < M; ++m) {  // (rows past mv: zeros, never stored)
                    xr[m][i] = m < mv ? ldcg16(x.p + m * x.s0 + kv * VEC) : make_uint4(0, 0, 0, 0);
                    if (xacc)
#pragma unroll
                        for (int a = 0; a < AV; ++a)
                            ar[SUMS ? m : 0][SUMS ? i : 0][a] =
                                m < mv ? ldcg16(sums.x.p + m * sums.x.s0 + kv * VEC + 4 * a) : make_uint4(0, 0, 0, 0);
                }
                if (NORM) gr[i] = ldcg16(g.p + kv * VEC);
            }
        }
        if (xacc) {  // x <- T(x + T(sum)), as acc_residual rounds
#pragma unroll
            for (int i = 0; i < NVX; ++i) {
                if (i * MEGA_THREADS + tid >= KV) continue;
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float f[VEC], a[VEC];
                    unpack16<T>(xr[m][i], f);
#pragma unroll
                    for (int v = 0; v < AV; ++v) unpack16<float>(ar[SUMS ? m : 0][SUMS ? i : 0][v], a + 4 * v);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) f[e] = round_to<T>(f[e] + round_to<T>(a[e]));
                    xr[m][i] = pack16<T>(f);
                }
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
    }
    mega_sync();
}

// A tile's rows as the register body deals them: warp w takes tile-local rows
// (gi * RB + rb) * MEGA_WARPS + w, row groups gi < ng of RB slots rb.
template <int RB>
struct Rows {
    int rows, ng;
    __device__ __forceinline__ explicit Rows(int n) : rows(n), ng(cdiv(cdiv(n, MEGA_WARPS), RB)) {}
    __device__ __forceinline__ int local(int gi, int rb, int warp) const { return (gi * RB + rb) * MEGA_WARPS + warp; }
};

// The fused epilogue for output element (m, n) of tile-local row `local`.
template <class T, bool GLU, bool RES>
__device__ __forceinline__ void finish(float dot, float dot2, const float* rt, int rows, int m, int local, long long n,
                                       Mat<T> out) {
    float y = round_to<T>(dot);
    if (GLU) y = round_to<T>(round_to<T>(silu_f32(y)) * round_to<T>(dot2));
    if (RES) y = round_to<T>(rt[m * rows + local] + y);
    out.p[m * out.s0 + n * out.s1] = from_f32<T>(y);
}

// ... or its f32 products as they are, a split's partial sum (run_wide for matvec_split.cuh): no rounding, no epilogue
template <class T, bool GLU, bool RES>
__device__ __forceinline__ void store_mma_output(float d, float, Mat<const T>, Mat<float> out, int m, long long n) {
    static_assert(!GLU && !RES, "store_mma_output: a partial sum has no gate or residual (the combine applies them)");
    out.p[m * out.s0 + n * out.s1] = d;
}

// Issue the 16-byte weight loads of step s of row group gi into wa (and wb), row slots [RB0, RB1).
// A slot past the tile or past N loads the tile's last row again (cached, finite; write_group
// drops its sums) instead of zeros: no select of zeros, no predicate (perf-notes #58; a predicated
// load that keeps the registers' old values measured larger, and so did a branch around the slot).
// The tile heights the cost model picks fill their slots (Rows), so only an op's ragged last tile
// re-reads a row.
template <class P, class T, bool GLU, int RB0 = 0, int RB1 = P::RB>
__device__ __forceinline__ void load_step(uint4 (&wa)[P::RB][P::U], uint4 (&wb)[GLU ? P::RB : 1][GLU ? P::U : 1],
                                          Mat<const T> w, Mat<const T> w2, long long row0, const Rows<P::RB>& rr, long long N,
                                          int gi, int s, int warp, int lane) {
    constexpr bool WHOLE = P::KV % (32 * P::U * P::STEPS) == 0;  // every step's vectors lie in the row
    const long long last = min_i64(row0 + rr.rows, N) - 1;
#pragma unroll
    for (int rb = RB0; rb < RB1; ++rb) {
        const long long n = min_i64(row0 + rr.local(gi, rb, warp), last);
        const T* wr = w.p + n * w.s0;
        const T* wr2 = GLU ? w2.p + n * w2.s0 : nullptr;
#pragma unroll
        for (int u = 0; u < P::U; ++u) {
            const int kv = (s * P::U + u) * 32 + lane;
            const bool in = WHOLE || kv < P::KV;
            wa[rb][u] = in ? ldw16(wr + kv * P::VEC) : make_uint4(0, 0, 0, 0);
            if (GLU) wb[GLU ? rb : 0][GLU ? u : 0] = in ? ldw16(wr2 + kv * P::VEC) : make_uint4(0, 0, 0, 0);
        }
    }
}

// Paced pre-wait loads (perf-notes #41): the first step's row slots are issued one at a time,
// each only once the previous one has landed, until the waits are met; then the rest at once.
// A waiting SM so keeps one slot (~32 KB) in flight instead of its whole first step, and the
// chain its producers run (attention, ~17 MB of O weights queued ahead of it on qwen3-8b)
// sees a short memory queue (perf-notes #39: unpaced, the bytes trade one for one).
template <class P, class T, bool GLU, int RB0>
__device__ __forceinline__ void paced_first_step(uint4 (&wa)[P::RB][P::U], uint4 (&wb)[GLU ? P::RB : 1][GLU ? P::U : 1],
                                                 Mat<const T> w, Mat<const T> w2, long long row0, const Rows<P::RB>& rr,
                                                 long long N, int warp, int lane, const MegaWaits& wl, float* red) {
    if constexpr (RB0 < P::RB) {
        load_step<P, T, GLU, RB0, RB0 + 1>(wa, wb, w, w2, row0, rr, N, 0, 0, warp, lane);
        if (RB0 + 1 == P::RB) return;
        if (mega_waits_met(wl)) {
            load_step<P, T, GLU, RB0 + 1, P::RB>(wa, wb, w, w2, row0, rr, N, 0, 0, warp, lane);
            return;
        }
        unsigned dep = 0;  // reading the slot's registers waits for its loads to land
#pragma unroll
        for (int u = 0; u < P::U; ++u) dep |= wa[RB0][u].x;
        if (lane == 0) red[warp] = __uint_as_float(dep);  // (scratch, one writer a word: the stage after the wait rewrites it)
        paced_first_step<P, T, GLU, RB0 + 1>(wa, wb, w, w2, row0, rr, N, warp, lane, wl, red);
    }
}

template <class P, int M, bool GLU>
__device__ __forceinline__ void zero_acc(float (&acc)[P::RB][M], float (&acc2)[GLU ? P::RB : 1][M]) {
#pragma unroll
    for (int rb = 0; rb < P::RB; ++rb)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[rb][m] = 0.0f, acc2[GLU ? rb : 0][m] = 0.0f;
}

// Multiply-accumulate k-step s of a row group from its register buffer.
template <class P, class T, class XS, int M, int K, bool GLU>
__device__ __forceinline__ void mac_step(const uint4 (&wa)[P::RB][P::U], const uint4 (&wb)[GLU ? P::RB : 1][GLU ? P::U : 1],
                                         float (&acc)[P::RB][M], float (&acc2)[GLU ? P::RB : 1][M], const XS* xs, int s,
                                         int lane) {
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
                    for (int e = 0; e < P::VEC; ++e) acc2[GLU ? rb : 0][m] = fmaf(wf[e], xf[m][e], acc2[GLU ? rb : 0][m]);
            }
        }
    }
}

// Reduce row group gi's dots across the warp and write its outputs (fused epilogue).
template <class P, class T, int M, bool GLU, bool RES>
__device__ __forceinline__ void write_group(float (&acc)[P::RB][M], float (&acc2)[GLU ? P::RB : 1][M], const float* rt,
                                            Mat<T> out, long long row0, const Rows<P::RB>& rr, long long N, int gi,
                                            int warp, int lane, int mv = M) {
#pragma unroll
    for (int rb = 0; rb < P::RB; ++rb) {
        const int local = rr.local(gi, rb, warp);
        const long long n = row0 + local;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float d = warp_sum(acc[rb][m]);
            const float d2 = GLU ? warp_sum(acc2[GLU ? rb : 0][m]) : 0.0f;
            if (lane == (rb * M + m) % 32 && local < rr.rows && n < N && m < mv)
                finish<T, GLU, RES>(d, d2, rt, rr.rows, m, local, n, out);
        }
    }
}

// Pipelined step t (row group t / STEPS, k-step t % STEPS): the group's first step zeroes
// acc, its last writes the outputs.
template <class P, class T, class XS, int M, int K, bool GLU, bool RES>
__device__ __forceinline__ void step(const uint4 (&wa)[P::RB][P::U], const uint4 (&wb)[GLU ? P::RB : 1][GLU ? P::U : 1],
                                     float (&acc)[P::RB][M], float (&acc2)[GLU ? P::RB : 1][M], const XS* xs,
                                     const float* rt, Mat<T> out, long long row0, const Rows<P::RB>& rr, long long N, int t,
                                     int warp, int lane, int mv) {
    const int gi = t / P::STEPS, s = t % P::STEPS;
    if (s == 0) zero_acc<P, M, GLU>(acc, acc2);
    mac_step<P, T, XS, M, K, GLU>(wa, wb, acc, acc2, xs, s, lane);
    if (s == P::STEPS - 1)
        write_group<P, T, M, GLU, RES>(acc, acc2, rt, out, row0, rr, N, gi, warp, lane, mv);
}

// Rows [n_tile * rows, ...) of out, in the code shape P (PlanFor). False when the wait gave up
// (abort or timeout): nothing was written.
template <class P, class T, int M, int K, bool NORM, bool GLU, bool RES, bool SUMS = false>
__device__ __forceinline__ bool run_vec_regs(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                             Mat<const T> w2, Mat<const T> r, const Sums& sums, Mat<T> out, long long N,
                                             long long n_tile, int rows, const MegaWaits& wl, int mv = M) {
    using XS = typename P::XS;
    float* red = P::red(smem);
    float* rt = P::rt(smem);
    XS* xs = P::xs(smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = n_tile * rows;
    const Rows<P::RB> rr(rows);

    if constexpr (P::PIPE) {
        // Steps t = 0 .. ng*STEPS-1 (row group t / STEPS, k-step t % STEPS) alternate between two
        // register buffers: step t+1's loads are in flight while step t computes, so an SM never
        // stops streaming between steps, nor while x stages after the wait.
        const int t_steps = rr.ng * P::STEPS;
        uint4 wa0[P::RB][P::U], wa1[P::RB][P::U];
        uint4 wb0[GLU ? P::RB : 1][GLU ? P::U : 1], wb1[GLU ? P::RB : 1][GLU ? P::U : 1];
        float acc[P::RB][M], acc2[GLU ? P::RB : 1][M];
        load_step<P, T, GLU>(wa0, wb0, w, w2, row0, rr, N, 0, 0, warp, lane);
        // The second buffer's loads: after the wait (issued before it, it measured slower: perf-notes #26), and
        // in a one-row ungated tile of K >= 2048 after x is staged, so that x's loads do not queue behind them
        // (a latency-bound op: llama-3.2-1b -1.5%); a gated tile, the bandwidth-bound MLP, keeps streaming (#108)
        constexpr bool stage_first = M == 1 && !GLU && K >= 2048;
        if (!mega_wait_all(wl)) return false;
        if (!stage_first && t_steps > 1)
            load_step<P, T, GLU>(wa1, wb1, w, w2, row0, rr, N, 1 / P::STEPS, 1 % P::STEPS, warp, lane);
        stage<T, XS, M, K, NORM, RES, SUMS>(xs, rt, red, x, g, eps, r, sums, row0, rows, N, mv);
        MEGA_TRACE_MARK();
        if (stage_first && t_steps > 1)
            load_step<P, T, GLU>(wa1, wb1, w, w2, row0, rr, N, 1 / P::STEPS, 1 % P::STEPS, warp, lane);
#pragma unroll 1
        for (int t = 0; t < t_steps; t += 2) {
            step<P, T, XS, M, K, GLU, RES>(wa0, wb0, acc, acc2, xs, rt, out, row0, rr, N, t, warp, lane, mv);
            if (t + 2 < t_steps)
                load_step<P, T, GLU>(wa0, wb0, w, w2, row0, rr, N, (t + 2) / P::STEPS, (t + 2) % P::STEPS, warp, lane);
            if (t + 1 < t_steps) {
                step<P, T, XS, M, K, GLU, RES>(wa1, wb1, acc, acc2, xs, rt, out, row0, rr, N, t + 1, warp, lane, mv);
                if (t + 3 < t_steps)
                    load_step<P, T, GLU>(wa1, wb1, w, w2, row0, rr, N, (t + 3) / P::STEPS, (t + 3) % P::STEPS, warp, lane);
            }
        }
    } else {
        // One buffer of 32 loads a lane, in nested loops: written as step() over a flat t,
        // qwen3-8b's GLU body spilled 64 bytes instead of 16 and the step ran 5.181 vs 5.149 ms
        // (same run).
        uint4 wa[P::RB][P::U];
        uint4 wb[GLU ? P::RB : 1][GLU ? P::U : 1];
        // in flight while the inputs' producers finish and x stages
        if (!GLU && P::RB > 1)  // an unpipelined, ungated tile paces its pre-wait loads
            paced_first_step<P, T, GLU, 0>(wa, wb, w, w2, row0, rr, N, warp, lane, wl, red);
        else
            load_step<P, T, GLU>(wa, wb, w, w2, row0, rr, N, 0, 0, warp, lane);
        if (!mega_wait_all(wl)) return false;
        stage<T, XS, M, K, NORM, RES, SUMS>(xs, rt, red, x, g, eps, r, sums, row0, rows, N, mv);
        MEGA_TRACE_MARK();

#pragma unroll 1
        for (int gi = 0; gi < rr.ng; ++gi) {
            float acc[P::RB][M], acc2[GLU ? P::RB : 1][M];
            zero_acc<P, M, GLU>(acc, acc2);
#pragma unroll 1
            for (int s = 0; s < P::STEPS; ++s) {
                if (gi | s) load_step<P, T, GLU>(wa, wb, w, w2, row0, rr, N, gi, s, warp, lane);
                mac_step<P, T, XS, M, K, GLU>(wa, wb, acc, acc2, xs, s, lane);
            }
            write_group<P, T, M, GLU, RES>(acc, acc2, rt, out, row0, rr, N, gi, warp, lane, mv);
        }
    }
    return true;
}


// Any strides and alignments, one generic copy per element type (shapes and fusions are runtime
// values): correct and slow. The compiler's own operands never take it (it is here for views, e.g.
// `matmul` through a permute); keeping it out of the shape templates keeps each of them
// ~12 KB of SASS smaller. x is re-read (and re-normalised) per output row instead of staged, so
// no shape limits it. `fl`: FL_* below.
enum : unsigned { FL_NORM = 1, FL_GLU = 2, FL_RES = 4 };

template <class T>
__device__ __noinline__ bool run_generic_body(char* smem, int M, long long K, int ROWS, unsigned fl, const T* xp,
                                              long long x_s0, long long x_s1, const T* gp, long long g_s0, float eps,
                                              const T* wp, long long w_s0, long long w_s1, const T* w2p, long long w2_s0,
                                              long long w2_s1, const T* rp, long long r_s0, long long r_s1,
                                              const Sums& sums, T* outp, long long out_s0, long long out_s1, long long N,
                                              long long n_tile, const MegaWaits& wl, int mv) {
    const Mat<const T> x{xp, x_s0, x_s1}, w{wp, w_s0, w_s1}, w2{w2p, w2_s0, w2_s1}, r{rp, r_s0, r_s1};
    const Vec<const T> g{gp, g_s0};
    const Mat<T> out{outp, out_s0, out_s1};
    if (!mega_wait_all(wl)) return false;
    float* red = reinterpret_cast<float*>(smem);        // [MEGA_WARPS]
    float* rinv = red + MEGA_WARPS;                      // [M]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // x[m, k] as read: T(x + T(xa)) when the sums are given (as stage() rounds)
    auto xv = [&](int m, long long k) {
        float v = ld_f32(x.p + m * x.s0 + k * x.s1);
        return sums.x.p ? round_to<T>(v + round_to<T>(ld_cg(sums.x.p + m * sums.x.s0 + k * sums.x.s1))) : v;
    };
#pragma unroll 1
    for (int m = 0; m < mv; ++m) {  // rinv[m] (1 without the norm)
        float ss = 0.0f;
        if (fl & FL_NORM)
#pragma unroll 1
            for (long long k = tid; k < K; k += MEGA_THREADS) ss += xv(m, k) * xv(m, k);
        ss = block_reduce_sum(ss, red);
        if (tid == 0) rinv[m] = fl & FL_NORM ? 1.0f / sqrtf(ss / (float)K + eps) : 1.0f;
        mega_sync();
    }
    const long long row0 = n_tile * ROWS;
#pragma unroll 1
    for (int i = warp; i < ROWS * mv; i += MEGA_WARPS) {
        const int local = i / mv, m = i % mv;
        const long long n = row0 + local;
        if (n >= N) break;
        float d = 0.0f, d2 = 0.0f;
#pragma unroll 1
        for (long long k = lane; k < K; k += 32) {
            float v = xv(m, k);
            if (fl & FL_NORM) v = round_to<T>(round_to<T>(v * rinv[m]) * ld_f32(g.p + k * g.s0));
            d = fmaf(ld_f32(w.p + n * w.s0 + k * w.s1), v, d);
            if (fl & FL_GLU) d2 = fmaf(ld_f32(w2.p + n * w2.s0 + k * w2.s1), v, d2);
        }
        d = warp_sum(d);
        d2 = warp_sum(d2);
        if (lane) continue;
        float y = round_to<T>(d);
        if (fl & FL_GLU) y = round_to<T>(round_to<T>(silu_f32(y)) * round_to<T>(d2));
        if (fl & FL_RES) {
            float rv = ld_f32(r.p + m * r.s0 + n * r.s1);
            if (sums.r.p) rv = round_to<T>(rv + round_to<T>(ld_cg(sums.r.p + m * sums.r.s0 + n * sums.r.s1)));
            y = round_to<T>(rv + y);
        }
        out.p[m * out.s0 + n * out.s1] = from_f32<T>(y);
    }
    return true;
}

// (out of line, the views' fields are separate parameters: a view passed by value to a call from a
// body that also uses it inline keeps it in local memory, and its pointers lose their address space)
template <class T>
__device__ __forceinline__ bool run_generic(char* smem, int M, long long K, int ROWS, unsigned fl, Mat<const T> x,
                                            Vec<const T> g, float eps, Mat<const T> w, Mat<const T> w2, Mat<const T> r,
                                            const Sums& sums, Mat<T> out, long long N, long long n_tile,
                                            const MegaWaits& wl, int mv) {
    return run_generic_body<T>(smem, M, K, ROWS, fl, x.p, x.s0, x.s1, g.p, g.s0, eps, w.p, w.s0, w.s1, w2.p, w2.s0,
                               w2.s1, r.p, r.s0, r.s1, sums, out.p, out.s0, out.s1, N, n_tile, wl, mv);
}

// --- several x rows on tensor cores (M a multiple of 8: a batch, a prompt) -------------------
// mma.sync m16n8k16 with the weights as A (16 rows x 16 k) and x as B (16 k x 8 rows), f32 accumulators.
// The k order inside an mma is free as long as A and B agree, so each lane loads its operands in
// 16-byte vectors straight from the natural layouts: lane (g = lane / 4, t = lane % 4) takes weight rows
// g and g + 8 and x row g at columns [kb + 8t, kb + 8t + 8) of every 32-column block kb, which feed two
// mmas (columns 8t..8t+3, then 8t+4..8t+7, as the slot pairs (2t, 2t+1) and (2t+8, 2t+9)). Warps take
// 16-row groups of the tile and, where the tile has fewer groups than warps, k slices of it, summed
// through shared memory. x comes from shared memory (staged, RMSNorm applied, when NORM) or straight
// from global memory (L2: it is small and every warp reads it).
template <class T> struct MmaKind;
template <> struct MmaKind<__nv_bfloat16> { static constexpr bool ok = true; };
template <> struct MmaKind<__half> { static constexpr bool ok = true; };
template <> struct MmaKind<float> { static constexpr bool ok = false; };

template <class T, int M, int K, int ROWS, bool NORM, bool GLU>
struct MmaPlan {
    static constexpr int NT = M / 8;                              // x tiles of 8 rows
    static constexpr int RG = cdiv(ROWS, 16);                     // weight row groups of 16
    static constexpr int KS = cmax(1, MEGA_WARPS / RG);           // k slices a group
    static constexpr int WORK = RG * KS;                          // warps with a (group, slice)
    static constexpr int KB = K / 32;                             // 32-column blocks
    static constexpr int KPS = cdiv(KB, KS);                      // blocks a slice
    // blocks a step: 32 weight loads a lane with a staged x (NORM: read from shared memory per
    // block, never held), else 16 beside the step's x loads (x from L2, held with the weights)
    static constexpr int U = (GLU ? 4 : 8) * (NORM ? 2 : 1);
    static constexpr int XS = K + 8;                              // staged x row stride (padded: no bank conflicts)
    static constexpr int XS_BYTES = NORM ? (M * XS * (int)sizeof(T) + 15) / 16 * 16 : 0;
    static constexpr int PART = WORK * 16 * M * (GLU ? 2 : 1);    // f32 partial sums
    static constexpr int BYTES = XS_BYTES + PART * 4;
    static_assert(RG <= MEGA_WARPS && M % 8 == 0 && K % 32 == 0, "matvec (mma): 16-row groups, 8-row x tiles, 32-column blocks");
    static_assert(BYTES <= MEGA_SMEM - MEGA_SMEM_RESERVED, "matvec (mma): staged x and partial sums do not fit in shared memory");
};

// One output element of the tensor-core bodies (run_mma, run_wide) from its f32 products: rounded, gated
// (GLU: d2 the up product), plus the residual (RES), stored at out[m, n].
template <class T, bool GLU, bool RES>
__device__ __forceinline__ void store_mma_output(float d, float d2, Mat<const T> r, Mat<T> out, int m, long long n) {
    float y = round_to<T>(d);
    if (GLU) y = round_to<T>(round_to<T>(silu_f32(y)) * round_to<T>(d2));
    if (RES) y = round_to<T>(ld_f32(r.p + m * r.s0 + n * r.s1) + y);
    out.p[m * out.s0 + n * out.s1] = from_f32<T>(y);
}

// GATHER: x row m is x[xrow[m]] (xrow in shared memory: moe_rows.cuh's rows of one expert), else x[m].
template <class T, int M, int K, int ROWS, bool NORM, bool GLU, bool RES, bool GATHER = false>
__device__ bool run_mma(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w, Mat<const T> w2,
                        Mat<const T> r, Mat<T> out, long long N, long long n_tile, const MegaWaits& wl, int mv,
                        const int* xrow = nullptr) {
    using P = MmaPlan<T, M, K, ROWS, NORM, GLU>;
    constexpr int VEC = VecN<T>::value, KV = K / VEC;
    T* xs = reinterpret_cast<T*>(smem);
    float* part = reinterpret_cast<float*>(smem + P::XS_BYTES);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
    const long long row0 = n_tile * ROWS;
    const bool active = warp < P::WORK;
    const int rg = warp / P::KS, ks = warp % P::KS;
    const int la = rg * 16 + gq, lb = la + 8;  // tile-local weight rows of this lane
    const bool oka = active && la < ROWS && row0 + la < N, okb = active && lb < ROWS && row0 + lb < N;
    const T* wa_p = w.p + (row0 + la) * w.s0 + t4 * 8;
    const T* wb_p = w.p + (row0 + lb) * w.s0 + t4 * 8;
    const T* va_p = GLU ? w2.p + (row0 + la) * w2.s0 + t4 * 8 : nullptr;
    const T* vb_p = GLU ? w2.p + (row0 + lb) * w2.s0 + t4 * 8 : nullptr;
    const int kb0 = ks * P::KPS, kb1 = cmin(P::KB, kb0 + P::KPS);
    const auto x_row = [&](int m) { return x.p + (GATHER ? xrow[m] : m) * x.s0; };
    float acc[P::NT][4], acc2[GLU ? P::NT : 1][4];
#pragma unroll
    for (int n = 0; n < P::NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f, acc2[GLU ? n : 0][e] = 0.0f;
    uint4 wa[P::U], wb[P::U], va[GLU ? P::U : 1], vb[GLU ? P::U : 1];
    const auto load_weights = [&](int kb) {  // the step's weight blocks, all in flight together
#pragma unroll
        for (int u = 0; u < P::U; ++u) {
            const int k = (kb + u) * 32;
            const bool in = active && kb + u < kb1;
            const uint4 z = make_uint4(0, 0, 0, 0);
            wa[u] = in && oka ? ldw16(wa_p + k) : z;
            wb[u] = in && okb ? ldw16(wb_p + k) : z;
            if (GLU) {
                va[GLU ? u : 0] = in && oka ? ldw16(va_p + k) : z;
                vb[GLU ? u : 0] = in && okb ? ldw16(vb_p + k) : z;
            }
        }
    };
    // the first step's weights depend on no producer: in flight through the wait and the x staging
    load_weights(kb0);
    if (!mega_wait_all(wl)) return false;
    if constexpr (NORM) {
        // stage x[M, K] as T, normalised: x <- T(T(x * rinv) * g). A warp takes whole rows: its sum
        // of squares needs no block barrier, and the loops stay rolled (unrolled over M and K this
        // body was 200 KB of SASS, fetched cold by every instance: ~12 us; perf-notes #72). Rows
        // past mv are left as they are: an x row only reaches its own output column.
        constexpr int CH = cmin(8, cdiv(KV, 32));  // 16-byte loads of a row in flight per lane
#pragma unroll 1
        for (int m = warp; m < mv && m < M; m += MEGA_WARPS) {
            float ss = 0.0f;
#pragma unroll 1
            for (int c = 0; c < KV; c += 32 * CH) {  // raw x into xs, and its squares summed
                uint4 v[CH];
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    const int kv = c + j * 32 + lane;
                    v[j] = kv < KV ? ldcg16(x_row(m) + kv * VEC) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    const int kv = c + j * 32 + lane;
                    float f[VEC];
                    unpack16<T>(v[j], f);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) ss += f[e] * f[e];
                    if (kv < KV) *reinterpret_cast<uint4*>(xs + m * P::XS + kv * VEC) = v[j];
                }
            }
            const float rinv = 1.0f / sqrtf(warp_sum(ss) / (float)K + eps);
#pragma unroll 1
            for (int c = 0; c < KV; c += 32 * CH) {  // normalised in place (each lane its own vectors)
                uint4 gv[CH];
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    const int kv = c + j * 32 + lane;
                    gv[j] = kv < KV ? ldcg16(g.p + kv * VEC) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    const int kv = c + j * 32 + lane;
                    if (kv >= KV) continue;
                    uint4* slot = reinterpret_cast<uint4*>(xs + m * P::XS + kv * VEC);
                    float f[VEC], gf[VEC];
                    unpack16<T>(*slot, f);
                    unpack16<T>(gv[j], gf);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) f[e] = round_to<T>(round_to<T>(f[e] * rinv) * gf[e]);
                    *slot = pack16<T>(f);
                }
            }
        }
        mega_sync();
    }
    if (active) {
#pragma unroll 1
        for (int kb = kb0; kb < kb1; kb += P::U) {
            if (kb != kb0) load_weights(kb);
            uint4 xv[NORM ? 1 : P::U][P::NT];
            if constexpr (!NORM) {  // x from L2, in flight with the weights
#pragma unroll
                for (int u = 0; u < P::U; ++u)
#pragma unroll
                    for (int n = 0; n < P::NT; ++n) {
                        const int m = n * 8 + gq;
                        xv[NORM ? 0 : u][n] = kb + u < kb1 && m < mv ? ldcg16(x_row(m) + (kb + u) * 32 + t4 * 8)
                                                                   : make_uint4(0, 0, 0, 0);
                    }
            }
#pragma unroll
            for (int u = 0; u < P::U; ++u) {
                const int xu = NORM ? 0 : u;
                if constexpr (NORM) {  // staged x (zeros past the last block: its weights are zeros too)
#pragma unroll
                    for (int n = 0; n < P::NT; ++n)
                        xv[0][n] = kb + u < kb1 ? *reinterpret_cast<const uint4*>(xs + (n * 8 + gq) * P::XS + (kb + u) * 32 + t4 * 8)
                                                : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int n = 0; n < P::NT; ++n) {
                    mma16816<T>(acc[n], wa[u].x, wb[u].x, wa[u].y, wb[u].y, xv[xu][n].x, xv[xu][n].y);
                    mma16816<T>(acc[n], wa[u].z, wb[u].z, wa[u].w, wb[u].w, xv[xu][n].z, xv[xu][n].w);
                    if (GLU) {
                        mma16816<T>(acc2[GLU ? n : 0], va[GLU ? u : 0].x, vb[GLU ? u : 0].x, va[GLU ? u : 0].y,
                                    vb[GLU ? u : 0].y, xv[xu][n].x, xv[xu][n].y);
                        mma16816<T>(acc2[GLU ? n : 0], va[GLU ? u : 0].z, vb[GLU ? u : 0].z, va[GLU ? u : 0].w,
                                    vb[GLU ? u : 0].w, xv[xu][n].z, xv[xu][n].w);
                    }
                }
            }
        }
        // accumulator (row g or g + 8 of the group, x rows n * 8 + 2t, + 1) -> part[warp][16][M]
        float* mine = part + warp * 16 * M;
#pragma unroll
        for (int n = 0; n < P::NT; ++n) {
            const int m = n * 8 + 2 * t4;
            mine[gq * M + m] = acc[n][0], mine[gq * M + m + 1] = acc[n][1];
            mine[(gq + 8) * M + m] = acc[n][2], mine[(gq + 8) * M + m + 1] = acc[n][3];
            if (GLU) {
                float* mine2 = part + (P::WORK + warp) * 16 * M;
                mine2[gq * M + m] = acc2[GLU ? n : 0][0], mine2[gq * M + m + 1] = acc2[GLU ? n : 0][1];
                mine2[(gq + 8) * M + m] = acc2[GLU ? n : 0][2], mine2[(gq + 8) * M + m + 1] = acc2[GLU ? n : 0][3];
            }
        }
    }
    mega_sync();
    for (int i = tid; i < ROWS * M; i += MEGA_THREADS) {  // the k slices summed, the epilogue, the store
        const int local = i / M, m = i % M;
        const long long n = row0 + local;
        if (m >= mv || n >= N) continue;
        const int grp = local / 16, rr = local % 16;
        float d = 0.0f, d2 = 0.0f;
#pragma unroll
        for (int s = 0; s < P::KS; ++s) {
            d += part[((grp * P::KS + s) * 16 + rr) * M + m];
            if (GLU) d2 += part[((P::WORK + grp * P::KS + s) * 16 + rr) * M + m];
        }
        store_mma_output<T, GLU, RES>(d, d2, r, out, m, n);
    }
    return true;
}

}  // namespace matvec_impl

#include "matvec_wide.cuh"

namespace matvec_impl {

// Which body an instance of this shape runs: tensor cores for x rows in tiles of 8, else the
// register body (run_vec_regs).
template <class T, int M, int K, bool SUMS>
__host__ __device__ constexpr bool use_mma() {
    return M % 8 == 0 && K % 32 == 0 && !SUMS && MmaKind<T>::ok;
}

// The out-of-line bodies take matvec()'s views as their fields (xp, x_s0, x_s1, ...) and rebuild them:
// passed by value, the views changed the registers these bodies' parameters arrive in and, in the
// largest, their spills (qwen3-1.7b's residual tile: 32/16 -> 40/40 bytes), and their pointers lost
// the address space the callers give them (the out stores went generic).

// The register body and its generic fallback, for tiles of code shape P: one copy per shape, however
// many tile heights use it. `rows` must be a height PlanFor was given for P (its shared memory bound).
template <class P, class T, int M, int K, bool HAS_NORM, bool HAS_GLU, bool HAS_RES, bool SUMS>
__device__ __noinline__ void matvec_regs(char* smem, const T* xp, long long x_s0, long long x_s1, const T* gp,
                                         long long g_s0, float eps, const T* wp, long long w_s0, long long w_s1,
                                         const T* w2p, long long w2_s0, long long w2_s1, const T* rp, long long r_s0,
                                         long long r_s1, const float* xap, long long xa_s0, long long xa_s1,
                                         const float* rap, long long ra_s0, long long ra_s1, T* outp, long long out_s0,
                                         long long out_s1, long long N, long long n_tile, int rows, long long mvalid,
                                         const MegaWaits wl) {
    const Mat<const T> x{xp, x_s0, x_s1}, w{wp, w_s0, w_s1}, w2{w2p, w2_s0, w2_s1}, r{rp, r_s0, r_s1};
    const Vec<const T> g{gp, g_s0};
    const Mat<T> out{outp, out_s0, out_s1};
    const Sums sums{{xap, xa_s0, xa_s1}, {rap, ra_s0, ra_s1}};
    smem = shared_ptr(smem);
    bool vec = K % VecN<T>::value == 0 && vec_rows_ok(w.p, w.s0, w.s1, K) && stage_vec_ok<T, M, K, HAS_NORM, SUMS>(x, g, sums);
    if (HAS_GLU) vec = vec && vec_rows_ok(w2.p, w2.s0, w2.s1, K);
    if constexpr (K % VecN<T>::value == 0) {
        if (vec) {
            run_vec_regs<P, T, M, K, HAS_NORM, HAS_GLU, HAS_RES, SUMS>(smem, x, g, eps, w, w2, r, sums, out, N, n_tile, rows,
                                                                       wl, (int)mvalid);
            return;
        }
    }
    run_generic<T>(smem, M, K, rows, (HAS_NORM ? FL_NORM : 0u) | (HAS_GLU ? FL_GLU : 0u) | (HAS_RES ? FL_RES : 0u), x, g,
                   eps, w, w2, r, sums, out, N, n_tile, wl, (int)mvalid);
}

// The body whose code depends on the tile height: the tensor-core one.
template <class T, int M, int K, int ROWS, bool HAS_NORM, bool HAS_GLU, bool HAS_RES, bool SUMS>
__device__ __noinline__ void matvec_fixed_rows(char* smem, const T* xp, long long x_s0, long long x_s1, const T* gp,
                                               long long g_s0, float eps, const T* wp, long long w_s0, long long w_s1,
                                               const T* w2p, long long w2_s0, long long w2_s1, const T* rp,
                                               long long r_s0, long long r_s1, const float* xap, long long xa_s0,
                                               long long xa_s1, const float* rap, long long ra_s0, long long ra_s1,
                                               T* outp, long long out_s0, long long out_s1, long long N,
                                               long long n_tile, long long mvalid, const MegaWaits wl) {
    const Mat<const T> x{xp, x_s0, x_s1}, w{wp, w_s0, w_s1}, w2{w2p, w2_s0, w2_s1}, r{rp, r_s0, r_s1};
    const Vec<const T> g{gp, g_s0};
    const Mat<T> out{outp, out_s0, out_s1};
    smem = shared_ptr(smem);
    if constexpr (use_mma<T, M, K, SUMS>()) {
        // x rows in tiles of 8: tensor cores. The compiler's operands are contiguous rows; anything
        // else is reported, not computed wrongly.
        const bool rows_ok = vec_rows_ok(w.p, w.s0, w.s1, K) && (!HAS_GLU || vec_rows_ok(w2.p, w2.s0, w2.s1, K)) &&
                             vec_rows_ok(x.p, x.s0, x.s1, K) && (!HAS_NORM || (g.s0 == 1 && aligned16(g.p)));
        if (!rows_ok) {
            if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
            return;
        }
        run_mma<T, M, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES>(smem, x, g, eps, w, w2, r, out, N, n_tile, wl, (int)mvalid);
    }
}

// A wide tile (matvec_wide.cuh) of 64 x rows, mvalid of them valid.
template <class T, int K, int ROWS, bool HAS_NORM, bool HAS_GLU, bool HAS_RES>
__device__ __noinline__ void matvec_wide_rows(char* smem, const T* xp, long long x_s0, long long x_s1, const T* gp,
                                              long long g_s0, float eps, const T* wp, long long w_s0, long long w_s1,
                                              const T* w2p, long long w2_s0, long long w2_s1, const T* rp,
                                              long long r_s0, long long r_s1, T* outp, long long out_s0,
                                              long long out_s1, long long N, long long n_tile, long long mvalid,
                                              const MegaWaits wl) {
    const Mat<const T> x{xp, x_s0, x_s1}, w{wp, w_s0, w_s1}, w2{w2p, w2_s0, w2_s1}, r{rp, r_s0, r_s1};
    const Vec<const T> g{gp, g_s0};
    const Mat<T> out{outp, out_s0, out_s1};
    smem = shared_ptr(smem);
    // contiguous 16-byte aligned rows (the compiler's operands are): anything else is reported
    const bool rows_ok = vec_rows_ok(w.p, w.s0, w.s1, K) && (!HAS_GLU || vec_rows_ok(w2.p, w2.s0, w2.s1, K)) &&
                         vec_rows_ok(x.p, x.s0, x.s1, K) && (!HAS_NORM || (g.s0 == 1 && aligned16(g.p)));
    if (!rows_ok) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        mega_wait_all(wl);
        return;
    }
    if (mvalid <= 32)  // half a tile: a ring of 32-row stages holds twice as many
        run_wide<T, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES, 32>(smem, x, g, eps, w, w2, r, out, N, n_tile, wl, (int)mvalid);
    else
        run_wide<T, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES, 64>(smem, x, g, eps, w, w2, r, out, N, n_tile, wl, (int)mvalid);
}

}  // namespace matvec_impl

// One instance: rows [n_tile*ROWS, min(n_tile*ROWS + ROWS, N)) of out[M, N], x, r, xa, ra and out
// already advanced to the instance's first x row. Absent operands (g, w2, r, xa, ra) are empty
// views (nullptr, zero strides). `wl`: the instance's barrier waits (n = 0: none). Picks the body;
// the register body takes ROWS as a runtime value (matvec_regs).
template <class T, int M, int K, int ROWS, bool HAS_NORM, bool HAS_GLU, bool HAS_RES, bool SUMS>
__device__ __forceinline__ void matvec(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                       Mat<const T> w2, Mat<const T> r, Mat<const float> xa, Mat<const float> ra,
                                       Mat<T> out, long long N, long long n_tile, long long mvalid, const MegaWaits wl) {
    static_assert(M >= 1 && K >= 1 && ROWS >= 1, "matvec: bad shape");
#define MEGA_MATVEC_FIELDS x.p, x.s0, x.s1, g.p, g.s0, eps, w.p, w.s0, w.s1, w2.p, w2.s0, w2.s1, r.p, r.s0, r.s1, xa.p, \
    xa.s0, xa.s1, ra.p, ra.s0, ra.s1, out.p, out.s0, out.s1
    if constexpr (M == MEGA_WIDE_M) {  // a runtime M's wide tile (megaegg/blockops/matvec.py: WIDE_MROWS)
        static_assert(matvec_impl::wide_fits<T, K, ROWS, HAS_GLU>() && !SUMS, "matvec: a wide tile of this shape");
        constexpr int MS = matvec_impl::staged_rows<T, K, HAS_NORM>();
        if constexpr (MS > 0) {
            if (mvalid <= MS) {  // few rows: the staged body, as a tile of MS rows
                matvec_impl::matvec_fixed_rows<T, MS, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES, SUMS>(smem, MEGA_MATVEC_FIELDS, N,
                                                                                              n_tile, mvalid, wl);
                return;
            }
        }
        matvec_impl::matvec_wide_rows<T, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES>(
            smem, x.p, x.s0, x.s1, g.p, g.s0, eps, w.p, w.s0, w.s1, w2.p, w2.s0, w2.s1, r.p, r.s0, r.s1, out.p, out.s0,
            out.s1, N, n_tile, mvalid, wl);
    } else if constexpr (matvec_impl::use_mma<T, M, K, SUMS>())
        matvec_impl::matvec_fixed_rows<T, M, K, ROWS, HAS_NORM, HAS_GLU, HAS_RES, SUMS>(smem, MEGA_MATVEC_FIELDS, N, n_tile,
                                                                                     mvalid, wl);
    else
        matvec_impl::matvec_regs<typename matvec_impl::PlanFor<T, M, K, ROWS, HAS_GLU, HAS_NORM>::type, T, M, K, HAS_NORM,
                                 HAS_GLU, HAS_RES, SUMS>(smem, MEGA_MATVEC_FIELDS, N, n_tile, ROWS, mvalid, wl);
#undef MEGA_MATVEC_FIELDS
}
