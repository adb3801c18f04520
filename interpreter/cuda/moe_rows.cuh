// Routed experts over many rows, grouped by expert (blockops/moe_rows.py). Both ops work in the op's own
// state[n, W] f32: columns [0, N) the rows' f32 sums, [N, N + top_k) the routing weights, [N + top_k,
// N + 2 * top_k) the expert ids (as f32).
// moe_route:   instance c0 routes rows [c0 * rows_per, ...), warp w row c0 * rows_per + w: the top_k of
//              softmax(logits[r, :E]) in f32, largest first, ties to the lower expert, divided by their sum
//              when `normalize`, rounded to T (reference.moe_routing); and zeroes the row's sums. NaN logits
//              report MEGA_ERR_NAN (the row) and route to expert 0 with weight 0.
// moe_experts: instance (used, n_tile) takes the used-th smallest expert id in the route (none left: it
//              returns), then M rows routed to it at a time (in row order): stages them (RMSNorm when
//              NORM), runs the gated matvec body's loop on the expert's rows [n_tile*ROWS, ...) into h in
//              shared memory, and adds weight * h @ wd[tile, :] into the row's f32 sum (glu_down's phase 2,
//              M rows). The interpreter has waited for the route and x (which expert, which rows is data).
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

// The used-th smallest expert id that any of the n rows chose, or -1 past the last. All threads call it; the
// flags use smem[0, 4 * E). Warp 0 counts: lane l owns experts [l * C, (l + 1) * C).
__device__ int used_expert(char* smem, Ten3<const float> route, long long n, int E, int top_k, long long used) {
    __shared__ int found;
    int* flag = reinterpret_cast<int*>(smem);
    for (int i = threadIdx.x; i < E; i += MEGA_THREADS) flag[i] = 0;
    mega_sync();
    for (long long i = threadIdx.x; i < n * top_k; i += MEGA_THREADS) {
        const int e = (int)ld_cg(route.p + (i / top_k) * route.s0 + route.s1 + (i % top_k) * route.s2);
        if (e >= 0 && e < E) flag[e] = 1;  // (same value from every writer)
    }
    mega_sync();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, C = (E + 31) / 32, lo = min(E, lane * C), hi = min(E, lo + C);
        int count = 0;
        for (int i = lo; i < hi; ++i) count += flag[i];
        int incl = count;  // inclusive prefix over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(MEGA_FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31 && used >= incl) found = -1;  // (past the last distinct expert)
        if (used >= incl - count && used < incl) {
            int k = (int)used - (incl - count);
            for (int i = lo; i < hi; ++i)
                if (flag[i] && k-- == 0) found = i;
        }
    }
    mega_sync();
    return found;
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

template <class T, int M, int K, int N, int ROWS, bool NORM>
__device__ __noinline__ void moe_experts(char* smem, Mat<const T> x, Vec<const T> g, float eps, Ten3<const float> route,
                                         long long n, int E, int top_k, Ten3<const T> w, Ten3<const T> w2,
                                         Ten3<const T> wd, Mat<float> acc, long long F, long long used,
                                         long long n_tile) {
    using namespace matvec_impl;
    using P = typename PlanFor<T, M, K, ROWS, true, NORM>::type;
    using XS = typename P::XS;
    in_global(x, route, w, w2, wd, acc);  // (not the optional g)
    constexpr int VEC = VecN<T>::value, NV = N / VEC, VPT = cdiv(NV, MEGA_THREADS);
    constexpr int RB = cmax(1, 16 / VPT);  // wd rows a batch of phase 2: up to 16 loads a thread
    constexpr int H_BYTES = (M * ROWS * (int)sizeof(T) + 15) / 16 * 16;
    static_assert(M >= 4 && !P::PIPE, "moe_experts: the register body's unpipelined loop (M >= 4 rows)");
    static_assert(K % VEC == 0 && N % VEC == 0, "moe_experts: weight rows must be whole 16-byte vectors");
    static_assert(H_BYTES + M * 8 + 16 <= MEGA_SMEM_RESERVED, "moe_experts: h and the rows do not fit the reserved smem");
    smem = shared_ptr(smem);
    char* top = smem + MEGA_SMEM - MEGA_SMEM_RESERVED;  // the top: matvec's body leaves it alone
    T* hs = reinterpret_cast<T*>(top);                  // h[M][ROWS]
    int* hit_row = reinterpret_cast<int*>(top + H_BYTES);  // [M] the rows of this pass, their weights,
    float* hit_w = reinterpret_cast<float*>(hit_row + M);  // how many, and where the next scan starts
    int* meta = reinterpret_cast<int*>(hit_w + M);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (!vec_rows_ok(x.p, x.s0, x.s1, K) || (NORM && !(g.s0 == 1 && aligned16(g.p)))) {
        if (tid == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);  // (the compiler's operands are contiguous rows)
        return;
    }
    const int e = moe_rows_impl::used_expert(smem, route, n, E, top_k, used);
    if (e < 0) return;
    const Mat<const T> we = w.at(e), w2e = w2.at(e), wde = wd.at(e);
    const long long row0 = n_tile * ROWS;
    const int rows = (int)min_i64(ROWS, F - row0);
    const Rows<P::RB> rr(rows);
    const Mat<T> h{hs - row0, ROWS, 1};  // h[m][j] at hs[m * ROWS + j - row0]
    long long cursor = 0;                // rows before it are scanned
#pragma unroll 1
    for (;;) {
        // the next M rows routed to e, in row order (warp 0: 32 rows a ballot)
        if (warp == 0) {
            int count = 0;
            long long r0 = cursor;
            while (count < M && r0 < n) {
                const long long r = r0 + lane;
                bool hit = false;
                float p = 0.0f;
                for (int j = 0; r < n && j < top_k && !hit; ++j)
                    if ((int)ld_cg(route.p + r * route.s0 + route.s1 + j * route.s2) == e)
                        hit = true, p = ld_cg(route.p + r * route.s0 + j * route.s2);
                const unsigned mask = __ballot_sync(MEGA_FULL_MASK, hit);
                const int take = min(__popc(mask), M - count), rank = __popc(mask & ((1u << lane) - 1));
                if (hit && rank < take) hit_row[count + rank] = (int)r, hit_w[count + rank] = p;
                r0 = take < __popc(mask) ? r0 + __fns(mask, 0, take + 1) : r0 + 32;  // (full: from the first not taken)
                count += take;
            }
            if (lane == 0) meta[0] = count, meta[1] = (int)min_i64(r0, n);
        }
        mega_sync();
        const int mv = meta[0];
        cursor = meta[1];
        if (mv == 0) break;
        // x rows staged (normalised when NORM) into xs[m] as the matvec body stages one row
        for (int m = 0; m < mv; ++m)
            stage<T, XS, 1, K, NORM, false, false>(P::xs(smem) + m * K, P::rt(smem), P::red(smem),
                                                   Mat<const T>{x.p + hit_row[m] * x.s0, 0, x.s1}, g, eps,
                                                   Mat<const T>{}, Sums{}, 0, 0, 0, 1);
        // h = T(T(silu(T(x we^T))) * T(x w2e^T)) for the tile's rows: the register body's loop (matvec.cuh); the
        // weights come from L2 after the expert's first pass
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
        // acc[row_m, :] += weight_m * h[m] @ wde[tile, :]; thread t owns 16-byte column vectors t, t + MEGA_THREADS, ...
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
            if (m < mv) glu_down_add<T, N>(acc.p + hit_row[m] * acc.s0, sum[m], hit_w[m]);
        if (mv < M) break;  // (the scan reached the last row)
        mega_sync();  // before the next pass rewrites xs, h and the rows
    }
}
