// Routed experts over many rows, grouped by expert (blockops/moe_rows.py). Both ops work in the op's own
// state[n, W] f32: columns [0, N) the rows' f32 sums, [N, N + top_k) the routing weights, [N + top_k,
// N + 2 * top_k) the expert ids (as f32).
// moe_route:   instance c0 routes rows [c0 * rows_per, ...), warp w row c0 * rows_per + w: the top_k of
//              softmax(logits[r, :E]) in f32, largest first, ties to the lower expert, divided by their sum
//              when `normalize`, rounded to T (reference.moe_routing); and zeroes the row's sums. NaN logits
//              report MEGA_ERR_NAN (the row) and route to expert 0 with weight 0.
// moe_experts: instance (b, n_tile) takes block b of the routed rows: the experts in increasing id order,
//              each one's rows in row order cut into blocks of BLOCK (none left: it returns); stages the
//              block's x rows (RMSNorm when NORM), computes the gated MLP's rows [n_tile*ROWS, ...) of its
//              expert into h in shared memory, and adds weight * h @ wd[tile, :] into each row's f32 sum.
//              bf16 / f16: on tensor cores (a BLOCK of 8 or 16 rows one MMA tile); else on CUDA cores, M rows
//              a pass. The interpreter has waited for the route and x (which expert, which rows is data).
#pragma once
#include "moe.cuh"

namespace moe_rows_impl {

// Warp-level routing of one row into weight[0, top_k) and id[0, top_k) (moe.cuh: warp_top_k); p: E + 2 * top_k
// floats of shared memory that only this warp uses.
template <class T, class TL>
__device__ void route_row(float* p, const TL* logits, long long ls, int E, int top_k, bool normalize, float* weight,
                          float* id, long long row) {
    const int lane = threadIdx.x & 31;
    float* top_v = p + E;                                  // [top_k] the chosen probabilities (lane 0 writes)
    int* top_i = reinterpret_cast<int*>(p + E + top_k);    // [top_k] their experts (E: none)
    const float chosen = moe_impl::warp_top_k(p, logits, ls, E, top_k, lane, [&](int j, float v, int e) {
        if (lane == 0) top_v[j] = v, top_i[j] = e;
    });
    __syncwarp();
    for (int j = lane; j < top_k; j += 32) {
        const bool nan = top_i[j] >= E;  // (NaN logits: no probability compares; none chosen)
        if (nan) mega_body_error(MEGA_ERR_NAN, row);
        weight[j] = nan ? 0.0f : round_to<T>(normalize ? top_v[j] / chosen : top_v[j]);
        id[j] = nan ? 0.0f : (float)top_i[j];
    }
}

// The b-th block of rows (experts in increasing id order, each expert's rows in row order cut into blocks of
// BLOCK): its expert, and its rows and their routing weights into hit_row[0, count) / hit_w; -1 past the last
// block. All threads call it; the counts use smem[0, 4 * E). Warp 0 finds the block: lane l owns experts
// [l * C, (l + 1) * C); then thread t scans rows [t * R, (t + 1) * R) for the expert's and ranks them.
template <int BLOCK>
__device__ int expert_block(char* smem, Ten3<const float> route, long long n, int E, int top_k, long long b,
                            int* hit_row, float* hit_w, int* count) {
    __shared__ int found, first, taken, warp_hits[MEGA_WARPS];
    int* hits = reinterpret_cast<int*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const auto id = [&](long long r, int j) { return (int)ld_cg(route.p + r * route.s0 + route.s1 + j * route.s2); };
    for (int i = tid; i < E; i += MEGA_THREADS) hits[i] = 0;
    mega_sync();
    for (long long i = tid; i < n * top_k; i += MEGA_THREADS) {
        const int e = id(i / top_k, (int)(i % top_k));
        if (e >= 0 && e < E) atomicAdd(hits + e, 1);
    }
    mega_sync();
    if (warp == 0) {
        const int C = (E + 31) / 32, lo = min(E, lane * C), hi = min(E, lo + C);
        int blocks = 0;
        for (int i = lo; i < hi; ++i) blocks += (hits[i] + BLOCK - 1) / BLOCK;
        int incl = blocks;  // inclusive prefix over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(MEGA_FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31 && b >= incl) found = -1;  // (past the last block)
        if (b >= incl - blocks && b < incl) {
            int k = (int)(b - (incl - blocks));
            for (int i = lo; i < hi; ++i) {
                const int nb = (hits[i] + BLOCK - 1) / BLOCK;
                if (k < nb) {
                    found = i, first = k * BLOCK, taken = min(BLOCK, hits[i] - k * BLOCK);
                    break;
                }
                k -= nb;
            }
        }
    }
    mega_sync();
    const int e = found;
    if (e < 0) return -1;
    // the expert's rows ranked [first, first + taken): a thread's rows' hits (at most one a row), ranked over the block
    const long long R = (n + MEGA_THREADS - 1) / MEGA_THREADS, r0 = tid * R, r1 = min_i64(n, r0 + R);
    int mine = 0;
    for (long long r = r0; r < r1; ++r)
        for (int j = 0; j < top_k; ++j)
            if (id(r, j) == e) {
                ++mine;
                break;
            }
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(MEGA_FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_hits[warp] = incl;
    mega_sync();
    int rank = incl - mine;
    for (int w = 0; w < warp; ++w) rank += warp_hits[w];
    if (mine > 0 && rank < first + taken && rank + mine > first)
        for (long long r = r0; r < r1 && rank < first + taken; ++r)
            for (int j = 0; j < top_k; ++j)
                if (id(r, j) == e) {
                    if (rank >= first)
                        hit_row[rank - first] = (int)r, hit_w[rank - first] = ld_cg(route.p + r * route.s0 + j * route.s2);
                    ++rank;
                    break;
                }
    *count = taken;
    mega_sync();
    return e;
}

// Down projection of a block on tensor cores: acc[hit_row[m], :] += hit_w[m] * h[m, :rows] @ wd[0:rows, :] for
// m < mv. h: [16][HS] T in shared memory (rows past mv and columns past `rows` zero); wd: the expert's [rows, N]
// tile. wd streams through a STAGES-deep cp.async ring of NC-column chunks at `ring`; warp w takes columns
// [8w, 8w + 8) of every chunk: D[16 x 8] = h (A, ldmatrix) x wd chunk (B, ldmatrix.trans), added by float2 atomics.
template <class T, int ROWS, int HS, int N>
struct DownPlan {
    static constexpr int JR = cdiv(ROWS, 32) * 32;   // h columns / wd rows, whole x4 ldmatrix loads (32 rows)
    static constexpr int NC = 8 * MEGA_WARPS;        // wd columns a chunk: 8 a warp
    static constexpr int LD = NC + 8;                // a chunk row's stride in elements (16-byte rows, no conflicts)
    static constexpr int STAGES = 4;                 // (3 chunks in flight: 48 KB)
    static constexpr int BYTES = STAGES * JR * LD * (int)sizeof(T);
    static_assert(HS >= JR && HS % 8 == 0, "moe_experts: h rows must cover the ldmatrix loads");
};

template <class T, int ROWS, int HS, int N>
__device__ void down_mma(char* ring, const T* hs, Mat<const T> wd, int rows, const int* hit_row, const float* hit_w,
                         int mv, Mat<float> acc) {
    using D = DownPlan<T, ROWS, HS, N>;
    constexpr int VPR = D::NC / 8, COPIES = D::JR * VPR, CHUNKS = cdiv(N, D::NC);
    T* st = reinterpret_cast<T*>(ring);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const auto issue = [&](int c) {  // chunk c -> its stage (rows past `rows`, columns past N: zeros)
        T* dst = st + (c % D::STAGES) * D::JR * D::LD;
        for (int i = tid; i < COPIES; i += MEGA_THREADS) {
            const int j = i / VPR, col = c * D::NC + (i % VPR) * 8;
            const bool ok = j < rows && col < N;
            cp_async16(dst + j * D::LD + (i % VPR) * 8, ok ? wd.p + j * wd.s0 + col : wd.p, ok ? 16 : 0);
        }
    };
    unsigned a[D::JR / 16][4];  // h as A fragments, all of its k steps
#pragma unroll
    for (int ks = 0; ks < D::JR / 16; ++ks) ldmatrix_x4(a[ks], hs + (lane & 15) * HS + ks * 16 + (lane >> 4) * 8);
    const int m0 = g, m1 = g + 8;
    const float p0 = m0 < mv ? hit_w[m0] : 0.0f, p1 = m1 < mv ? hit_w[m1] : 0.0f;
    float* out0 = m0 < mv ? acc.p + hit_row[m0] * acc.s0 : nullptr;
    float* out1 = m1 < mv ? acc.p + hit_row[m1] * acc.s0 : nullptr;
#pragma unroll
    for (int c = 0; c < D::STAGES - 1; ++c) {
        if (c < CHUNKS) issue(c);
        cp_async_commit();
    }
#pragma unroll 1
    for (int c = 0; c < CHUNKS; ++c) {
        cp_async_wait<D::STAGES - 2>();  // chunk c landed (this thread's copies) ...
        mega_sync();                     // ... and everyone's; and chunk c - 1's stage is free again
        if (c + D::STAGES - 1 < CHUNKS) issue(c + D::STAGES - 1);
        cp_async_commit();
        const int col = c * D::NC + warp * 8;
        if (col >= N) continue;
        const T* b = st + (c % D::STAGES) * D::JR * D::LD + warp * 8;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k2 = 0; k2 < D::JR / 32; ++k2) {
            unsigned bf[4];  // k steps 2 * k2 and 2 * k2 + 1: wd rows 32 * k2 + lane, columns [8w, 8w + 8)
            ldmatrix_x4_trans(bf, b + (k2 * 32 + lane) * D::LD);
            mma16816<T>(d, a[2 * k2][0], a[2 * k2][1], a[2 * k2][2], a[2 * k2][3], bf[0], bf[1]);
            mma16816<T>(d, a[2 * k2 + 1][0], a[2 * k2 + 1][1], a[2 * k2 + 1][2], a[2 * k2 + 1][3], bf[2], bf[3]);
        }
        if (out0) atomicAdd(reinterpret_cast<float2*>(out0 + col + 2 * t4), make_float2(p0 * d[0], p0 * d[1]));
        if (out1) atomicAdd(reinterpret_cast<float2*>(out1 + col + 2 * t4), make_float2(p1 * d[2], p1 * d[3]));
    }
    cp_async_wait<0>();
}

}  // namespace moe_rows_impl

template <class T, class TL>
__device__ __noinline__ void moe_route(char* smem, Mat<const TL> logits, int E, int top_k, bool normalize,
                                       Mat<float> state, int N, int W, long long n, int rows_per, long long c0) {
    in_global(logits, state);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if ((long long)rows_per * (E + 2 * top_k) * 4 > MEGA_SMEM || rows_per > MEGA_WARPS) {  // (moe_rows.py: ROUTE_FLOATS)
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        return;
    }
    const long long row = c0 * rows_per + warp;
    if (warp >= rows_per || row >= n) return;  // (no block barrier below: each warp routes alone)
    float* s = state.p + row * state.s0;
    for (int i = lane; i < N; i += 32) s[i] = 0.0f;  // the sums the experts add into
    float* p = shared_ptr<float>(smem) + warp * (E + 2 * top_k);
    moe_rows_impl::route_row<T>(p, logits.p + row * logits.s0, logits.s1, E, top_k, normalize, s + N, s + N + top_k, row);
    for (int i = N + 2 * top_k + lane; i < W; i += 32) s[i] = 0.0f;  // (the padding: every element written)
}

// The tensor-core body of block (e, rows hit_row[0, mv)) and row tile row0: h = the gated matvec of the gathered
// x rows (matvec.cuh: run_mma, x staged and normalised there), into hs after run_mma's shared memory; then
// the down projection (down_mma) through a ring over what run_mma used, or past hs where that is too small.
template <class T, int BLOCK, int K, int N, int ROWS, bool NORM>
__device__ void moe_block_mma(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> we, Mat<const T> w2e,
                              Mat<const T> wde, Mat<float> acc, long long F, long long row0, int rows,
                              const int* hit_row, const float* hit_w, int mv) {
    using P = matvec_impl::MmaPlan<T, BLOCK, K, ROWS, NORM, true>;
    constexpr int HS = cdiv(ROWS, 32) * 32 + 8;  // h row stride (elements): 16-byte rows, no ldmatrix conflicts
    constexpr int H_BYTES = 16 * HS * (int)sizeof(T);
    using D = moe_rows_impl::DownPlan<T, ROWS, HS, N>;
    constexpr int RING = D::BYTES <= P::BYTES ? 0 : P::BYTES + H_BYTES;
    static_assert(P::BYTES + H_BYTES <= MEGA_SMEM - MEGA_SMEM_RESERVED && RING + D::BYTES <= MEGA_SMEM - MEGA_SMEM_RESERVED,
                  "moe_experts: x, h and the down projection's ring do not fit in shared memory");
    T* hs = reinterpret_cast<T*>(smem + P::BYTES);
    for (int i = threadIdx.x; i < H_BYTES / 16; i += MEGA_THREADS) reinterpret_cast<uint4*>(hs)[i] = make_uint4(0, 0, 0, 0);
    // (run_mma's block barriers order the zeros before its epilogue writes h)
    matvec_impl::run_mma<T, BLOCK, K, ROWS, NORM, true, false, true>(smem, x, g, eps, we, w2e, Mat<const T>{}, Mat<T>{hs - row0, HS, 1},
                                                                      F, row0 / ROWS, MegaWaits{}, mv, hit_row);
    mega_sync();  // h complete; x and the partial sums are free
    moe_rows_impl::down_mma<T, ROWS, HS, N>(smem + RING, hs, Mat<const T>{wde.p + row0 * wde.s0, wde.s0, 1}, rows, hit_row,
                                            hit_w, mv, acc);
}

// The CUDA-core body of the same, M rows at a time: staged (RMSNorm when NORM), the gated matvec body's loop
// on the expert's rows into h in the reserved top of shared memory, and acc[row, :] += weight * h @ wd[tile, :]
// (glu_down's phase 2, M rows).
template <class T, int M, int K, int N, int ROWS, bool NORM>
__device__ void moe_block_regs(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> we, Mat<const T> w2e,
                               Mat<const T> wde, Mat<float> acc, long long F, long long row0, int rows,
                               const int* hit_row, const float* hit_w, int count, T* hs) {
    using namespace matvec_impl;
    using P = typename PlanFor<T, M, K, ROWS, true, NORM>::type;
    using XS = typename P::XS;
    constexpr int VEC = VecN<T>::value, NV = N / VEC, VPT = cdiv(NV, MEGA_THREADS);
    constexpr int RB = cmax(1, 16 / VPT);  // wd rows a batch of phase 2: up to 16 loads a thread
    static_assert(M >= 4 && !P::PIPE, "moe_experts: the register body's unpipelined loop (M >= 4 rows)");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const Rows<P::RB> rr(rows);
    const Mat<T> h{hs - row0, ROWS, 1};  // h[m][j] at hs[m * ROWS + j - row0]
#pragma unroll 1
    for (int m0 = 0; m0 < count; m0 += M) {
        const int mv = min(M, count - m0);
        if (m0 > 0) mega_sync();  // the previous pass is done with xs and h
        for (int m = 0; m < mv; ++m)
            stage<T, XS, 1, K, NORM, false, false>(P::xs(smem) + m * K, P::rt(smem), P::red(smem),
                                                   Mat<const T>{x.p + hit_row[m0 + m] * x.s0, 0, x.s1}, g, eps,
                                                   Mat<const T>{}, Sums{}, 0, 0, 0, 1);
        // h = T(T(silu(T(x we^T))) * T(x w2e^T)) for the tile's rows (the weights from L2 after the first pass)
#pragma unroll 1
        for (int gi = 0; gi < rr.ng; ++gi) {
            uint4 wa[P::RB][P::U], wb[P::RB][P::U];
            float a[P::RB][M], a2[P::RB][M];
            zero_acc<P, M, true>(a, a2);
#pragma unroll 1
            for (int s = 0; s < P::STEPS; ++s) {
                load_step<P, T, true>(wa, wb, we, w2e, row0, rr, F, gi, s, warp, lane);
                mac_step<P, T, XS, M, K, true>(wa, wb, a, a2, P::xs(smem), s, lane);
            }
            write_group<P, T, M, true, false>(a, a2, nullptr, h, row0, rr, F, gi, warp, lane, mv);
        }
        mega_sync();  // h complete
        // thread t owns 16-byte column vectors t, t + MEGA_THREADS, ... of the sum
        const T* base = wde.p + row0 * wde.s0;
        float sum[M][VPT][VEC];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int v = 0; v < VPT; ++v)
#pragma unroll
                for (int c = 0; c < VEC; ++c) sum[m][v][c] = 0.0f;
#pragma unroll 1
        for (int j0 = 0; j0 < rows; j0 += RB) {
            uint4 b[RB][VPT];
#pragma unroll
            for (int r = 0; r < RB; ++r)
#pragma unroll
                for (int v = 0; v < VPT; ++v) {
                    const int vi = v * MEGA_THREADS + tid;
                    const long long j = min(j0 + r, rows - 1);  // (past the tile: its last row again, h is 0 there)
                    b[r][v] = NV % MEGA_THREADS == 0 || vi < NV ? ldw16(base + j * wde.s0 + vi * VEC) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int r = 0; r < RB; ++r)
#pragma unroll
                for (int v = 0; v < VPT; ++v) {
                    float f[VEC];
                    unpack16<T>(b[r][v], f);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const float hj = m < mv && j0 + r < rows ? to_f32(hs[m * ROWS + j0 + r]) : 0.0f;
#pragma unroll
                        for (int c = 0; c < VEC; ++c) sum[m][v][c] = fmaf(f[c], hj, sum[m][v][c]);
                    }
                }
        }
#pragma unroll
        for (int m = 0; m < M; ++m)
            if (m < mv) glu_down_add<T, N>(acc.p + hit_row[m0 + m] * acc.s0, sum[m], hit_w[m0 + m]);
    }
}

// Instance (b, n_tile): block b of the routed rows (moe_rows_impl::expert_block: BLOCK rows of one expert)
// through rows [n_tile * ROWS, ...) of the expert's MLP. MMA: on tensor cores (moe_rows.py: expert_block), a
// BLOCK of 8 or 16 rows one MMA tile; else CUDA cores, M rows a pass.
template <class T, int M, int BLOCK, bool MMA, int K, int N, int ROWS, bool NORM>
__device__ __noinline__ void moe_experts(char* smem, Mat<const T> x, Vec<const T> g, float eps, Ten3<const float> route,
                                         long long n, int E, int top_k, Ten3<const T> w, Ten3<const T> w2,
                                         Ten3<const T> wd, Mat<float> acc, long long F, long long b, long long n_tile) {
    static_assert(!MMA || (matvec_impl::MmaKind<T>::ok && K % 32 == 0 && (BLOCK == 8 || BLOCK == 16)),
                  "moe_experts: tensor cores take bf16 / f16, K in 32-column blocks, blocks of 8 or 16 rows");
    constexpr int VEC = VecN<T>::value;
    constexpr int H_BYTES = MMA ? 0 : (M * ROWS * (int)sizeof(T) + 15) / 16 * 16;  // (the CUDA-core body's h)
    static_assert(K % VEC == 0 && N % VEC == 0, "moe_experts: weight rows must be whole 16-byte vectors");
    static_assert(H_BYTES + BLOCK * 8 + 16 <= MEGA_SMEM_RESERVED, "moe_experts: h and the rows do not fit the reserved smem");
    in_global(x, route, w, w2, wd, acc);  // (not the optional g)
    smem = shared_ptr(smem);
    char* top = smem + MEGA_SMEM - MEGA_SMEM_RESERVED;  // the top: matvec's bodies leave it alone
    T* hs = reinterpret_cast<T*>(top);                  // (the CUDA-core body's h[M][ROWS])
    int* hit_row = reinterpret_cast<int*>(top + H_BYTES);  // [BLOCK] the block's rows and their weights
    float* hit_w = reinterpret_cast<float*>(hit_row + BLOCK);
    const auto experts_ok = [](Ten3<const T> t, int cols) {  // every expert's rows whole 16-byte vectors
        return vec_rows_ok(t.p, t.s1, t.s2, cols) && ((t.s0 * (long long)sizeof(T)) & 15) == 0;
    };
    if (!vec_rows_ok(x.p, x.s0, x.s1, K) || (NORM && !(g.s0 == 1 && aligned16(g.p))) ||
        (MMA && !(experts_ok(w, K) && experts_ok(w2, K) && experts_ok(wd, N) && acc.s1 == 1 && (acc.s0 & 1) == 0 &&
                  ((unsigned long long)acc.p & 7) == 0))) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);  // (the compiler's operands are contiguous rows)
        return;
    }
    int count;
    const int e = moe_rows_impl::expert_block<BLOCK>(smem, route, n, E, top_k, b, hit_row, hit_w, &count);
    if (e < 0) return;
    const Mat<const T> we = w.at(e), w2e = w2.at(e), wde = wd.at(e);
    const long long row0 = n_tile * ROWS;
    const int rows = (int)min_i64(ROWS, F - row0);
    if constexpr (MMA)
        moe_block_mma<T, BLOCK, K, N, ROWS, NORM>(smem, x, g, eps, we, w2e, wde, acc, F, row0, rows, hit_row, hit_w, count);
    else
        moe_block_regs<T, M, K, N, ROWS, NORM>(smem, x, g, eps, we, w2e, wde, acc, F, row0, rows, hit_row, hit_w, count, hs);
}
