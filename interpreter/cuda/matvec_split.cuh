// matvec_split<T, K, S, ROWS, RES>: a runtime M's matvec [+ residual] split over K
// (megaegg/blockops/matvec_split.py). Instance (c0, c1, c2): weight rows [c0*ROWS, +ROWS) and x rows
// [c1*64, +64) (x, r and out arrive advanced to them); what c2 is depends on M, the x rows of the op:
// - 16 < M <= 64 (one row tile): K columns [c2*K/S, +K/S). Each split runs the wide tile
//   (matvec_wide.cuh) on its columns with f32 output into its partial tile part[(c0*S + c2) * 64 * ROWS
//   ...] ([x row][weight row]); then its arrival at the tile's counter arrive[c0] (in the launch-zeroed
//   counter bank; common.cuh: mega_last_arrival). The last split sums the partials in split order (the
//   same sum whichever arrives last), rounds, adds the residual and stores the tile.
// - M <= 16: nothing is split. c2 (0 or 1) picks half of the tile's weight rows, [c0*ROWS + c2*ROWS/2,
//   +ROWS/2), over all of K, the staged body writing out directly, as a matvec of ROWS/2-row tiles would:
//   at so few rows the combine, a dependent round trip, costs more than the fewer x reads of larger tiles
//   save (docs/perf-notes.md #87).
// - M > 64: c2 = 0, the unsplit matvec (the partials hold one row tile).
#pragma once
#include "matvec.cuh"

#define MEGA_SPLIT_FEW 16  // x rows up to which an instance is half a tile, unsplit (megaegg/blockops/matvec_split.py: FEW_ROWS)

namespace matvec_impl {

// The split's products into its f32 partial tile (weight-row-local columns): false if the launch aborted.
// More than 16 x rows (MEGA_SPLIT_FEW): the wide tile, with stages of 32 rows for at most 32.
template <class T, int KS, int ROWS>
__device__ __noinline__ bool split_products(char* smem, const T* xp, long long x_s0, const T* wp, long long w_s0,
                                            float* tile, long long N, long long n_tile, long long mvalid,
                                            const MegaWaits wl) {
    smem = shared_ptr(smem);
    const Mat<const T> x{xp, x_s0, 1}, w{wp, w_s0, 1}, none{};
    const Mat<float> out{tile - n_tile * ROWS, ROWS, 1};  // out[m, n] = tile[m * ROWS + n - row0]
    if (mvalid <= 32)
        return run_wide<T, KS, ROWS, false, false, false, 32, float>(smem, x, Vec<const T>{}, 0.0f, w, none, none, out, N,
                                                                      n_tile, wl, (int)mvalid);
    return run_wide<T, KS, ROWS, false, false, false, 64, float>(smem, x, Vec<const T>{}, 0.0f, w, none, none, out, N,
                                                                  n_tile, wl, (int)mvalid);
}

// The last split: the S partial tiles summed in split order (common.cuh: mega_combine_partials), rounded,
// the residual added, stored.
template <class T, int S, int ROWS, bool RES>
__device__ __noinline__ void split_combine(const float* tiles, const T* rp, long long r_s0, long long r_s1, T* outp,
                                           long long out_s0, long long out_s1, long long N, long long n_tile,
                                           long long mvalid) {
    const long long row0 = n_tile * ROWS;  // the tile's first weight row: its first output column
    T* const o = outp + row0 * out_s1;
    const auto epi = [&](int m, int c, const float (&y)[4], const float (&)[4], const float (&res)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (row0 + c + j >= N) break;
            float v = round_to<T>(y[j]);
            if (RES) v = round_to<T>(res[j] + v);
            o[m * out_s0 + (c + j) * out_s1] = from_f32<T>(v);
        }
    };
    mega_combine_partials<S, false>(tiles, ROWS, (long long)MEGA_WIDE_M * ROWS, (int)mvalid, (int)min_i64(ROWS, N - row0),
                                    0, RES ? rp + row0 * r_s1 : (const T*)nullptr, r_s0, r_s1, epi);
}

}  // namespace matvec_impl

template <class T, int K, int S, int ROWS, bool HAS_RES>
__device__ __forceinline__ void matvec_split(char* smem, Mat<const T> x, Mat<const T> w, Mat<const T> r, Mat<T> out,
                                             float* part, unsigned* arrive, long long N, long long n_tile,
                                             long long split, long long M, long long mvalid, const MegaWaits wl) {
    static_assert(K % S == 0 && (K / S) % 64 == 0 && ROWS % 16 == 0 && matvec_impl::wide_fits<T, K / S, ROWS, false>(),
                  "matvec_split: K / S a multiple of 64, a wide tile of ROWS rows (a multiple of 16)");
    if (M <= MEGA_SPLIT_FEW) {  // few x rows: half `split` of the tile's rows, the staged body over all of K
        const long long r0 = n_tile * ROWS + split * (ROWS / 2);
        if (r0 >= N) {  // past the weight's rows: nothing to write
            mega_wait_all(wl);
            return;
        }
        matvec_impl::matvec_fixed_rows<T, MEGA_SPLIT_FEW, K, ROWS / 2, false, false, HAS_RES, false>(
            smem, x.p, x.s0, x.s1, nullptr, 0, 0.0f, w.p + r0 * w.s0, w.s0, w.s1, nullptr, 0, 0, r.p + r0 * r.s1, r.s0,
            r.s1, nullptr, 0, 0, nullptr, 0, 0, out.p + r0 * out.s1, out.s0, out.s1, N - r0, 0, mvalid, wl);
        return;
    }
    if (M > MEGA_WIDE_M) {  // more x rows than one tile: the unsplit matvec
        matvec<T, MEGA_WIDE_M, K, ROWS, false, false, HAS_RES, false>(smem, x, Vec<const T>{}, 0.0f, w, Mat<const T>{}, r,
                                                                      Mat<const float>{}, Mat<const float>{}, out, N, n_tile,
                                                                      mvalid, wl);
        return;
    }
    constexpr int KS = K / S;
    in_global(x, w, out);
    part = global_ptr(part);
    // contiguous 16-byte aligned rows (the compiler's operands are): anything else is reported
    if (!(vec_rows_ok(w.p, w.s0, w.s1, K) && vec_rows_ok(x.p, x.s0, x.s1, K))) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        mega_wait_all(wl);
        return;
    }
    float* tiles = part + n_tile * S * (MEGA_WIDE_M * ROWS);
    if (!matvec_impl::split_products<T, KS, ROWS>(smem, x.p + split * KS, x.s0, w.p + split * KS, w.s0,
                                                  tiles + split * (MEGA_WIDE_M * ROWS), N, n_tile, mvalid, wl))
        return;
    if (mega_last_arrival(arrive + n_tile, S))
        matvec_impl::split_combine<T, S, ROWS, HAS_RES>(tiles, r.p, r.s0, r.s1, out.p, out.s0, out.s1, N, n_tile, mvalid);
}
