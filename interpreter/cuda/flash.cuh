// ragged_flash (megaegg/blockops/flash_attention.py): attention over a prompt on tensor cores.
//
// Instance (c0, c1): tokens [c0*BT, c0*BT + BT) of q [N, Hq, D] (BT = 128 / G) and the G query heads of
// KV head c1: 128 tile rows, row r = token c0*BT + r / G, head c1*G + r % G. Warp w owns rows
// [16w, 16w + 16): one m16 tile of mma.sync m16n8k16 (bf16 in, f32 accumulators).
//
// Rows attend cache rows [0, pos] of their slot. The tile runs one pass per distinct slot of its rows
// (a prompt: one pass), numbered in order of the slot's first row; instance c2 of `splits` runs passes c2,
// c2 + splits, ... (a mixed step's tile of decode rows, a pass a row, on several SMs; an instance past the
// tile's passes stops after counting). A pass streams K/V blocks of 64 or 128 cache rows (block_rows)
// through a cp.async ring in shared memory (rows padded to D + 8 elements: 16-byte aligned, ldmatrix
// without bank conflicts; as many stages as fit, up to 4, so 2-3 blocks are in flight while one is
// computed; one block barrier a block) and keeps, per row, the running max and sum (online softmax, base
// 2) and the f32 output in registers.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4):
//   A (16 x 16): {a0 a1} row g, cols 2t, 2t+1; {a2 a3} row g+8; {a4 a5} row g, cols 2t+8, 2t+9; {a6 a7} row g+8
//   B (16 x 8):  {b0 b1} k 2t, 2t+1, col g; {b2 b3} k 2t+8, 2t+9
//   C (16 x 8):  {c0 c1} row g, cols 2t, 2t+1; {c2 c3} row g+8
// S = Q K^T: A from q (pairs along D: one 32-bit load each), B from K with ldmatrix (rows = cache rows).
// ROPE: q is read unrotated (the Q projection's output) and rotated (NORM: RMS-normalised over D with g
// first, qwen3's q norm) as it is loaded, as rope.cuh's rope_rotate rounds it (HF: as Hugging Face's
// apply_rotary_pos_emb): a thread holds columns
// 16kk + 2t + {0, 1, 8, 9} of its rows, so both halves of each rotation pair (j, j + D/2: kk + D/32)
// are in its registers; a row's sum of squares is its quad's (two shuffles). The tile's cos / sin
// (BT tokens x D/2) go to shared memory first, one accurate sincosf each from a loop that is not
// unrolled: the G heads of a token share them, and 16-32 inlined sincosf (slow paths included) made the
// body 53 KB instead of 30, fetched cold by every instance (perf-notes #81).
// O += P V: A is P, the S accumulators rounded to bf16 (the C layout of two n8 tiles is the A layout of
// one k16 tile), B from V with ldmatrix.trans.
#pragma once
#include "common.cuh"
#include "kv_pages.cuh"
#include "rope.cuh"

namespace flash_detail {

constexpr int ROWS = 128;  // tile rows: 8 warps x m16

// Ring stages of K/V blocks (each K and V, `block` rows of D + 8 elements) that fit MEGA_SMEM beside the
// tile's token table and `extra` bytes: 4, or fewer for a big D in a small image; at least 2.
template <int D, int BT> __host__ __device__ constexpr int ring_stages(int block, int extra) {
    return cmax(2, cmin(4, (MEGA_SMEM - 3 * BT * 4 - extra) / (2 * block * (D + 8) * 2)));
}
// Cache rows a K/V block: 128 where D <= 64 and 3 stages of them fit (half the block barriers and twice
// the independent MMAs between them: the D = 64 body alone 12% faster at 2048 tokens, flash_probe.py),
// else 64 (at D = 128, 128-row blocks spill: 255 registers). FLASH_BLOCK forces one (an experiment).
template <int D, int BT> __host__ __device__ constexpr int block_rows(int extra) {
#ifdef FLASH_BLOCK
    return FLASH_BLOCK;
#else
    return D <= 64 && (MEGA_SMEM - 3 * BT * 4 - extra) / (2 * 128 * (D + 8) * 2) >= 3 ? 128 : 64;
#endif
}

// The first bad index of the tile (a position, slot or page), kept with its flag: -1 is a value too.
__device__ __forceinline__ void flag_bad(int& set, int& bad, int value) {
    if (atomicCAS(&set, 0, 1) == 0) bad = value;
}

__device__ __forceinline__ void mma16816a(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma16816<__nv_bfloat16>(c, a[0], a[1], a[2], a[3], b0, b1);
}


__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}

__device__ __forceinline__ float exp2f_fast(float x) {  // 2^x (2^-inf = 0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One row's q fragments (a thread's D/4 values of it: qa[kk][h] and qa[kk][h + 2]) rotated by its token's
// cos / sin (D/2 each, in shared memory) [after an RMSNorm with g]. `t`: the thread's column pair (lane % 4).
template <int D, bool NORM, bool HF>
__device__ __forceinline__ void rope_q_row(unsigned (&qa)[D / 16][4], int h, const float* cos_row, const float* sin_row,
                                           int t, Vec<const __nv_bfloat16> g, float eps) {
    float x[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa[kk][h]));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa[kk][h + 2]));
        x[kk][0] = lo.x, x[kk][1] = lo.y, x[kk][2] = hi.x, x[kk][3] = hi.y;
    }
    constexpr int OFF[4] = {0, 1, 8, 9};
    if (NORM) {
        float ss = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += x[kk][e] * x[kk][e];
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        const float rinv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 16 * kk + 2 * t + OFF[e];
                x[kk][e] = round_to<__nv_bfloat16>(round_to<__nv_bfloat16>(x[kk][e] * rinv) * ld_f32(g.p + c * g.s0));
            }
    }
    constexpr int HK = D / 32;  // k16 blocks of a half
#pragma unroll
    for (int kk = 0; kk < HK; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = 16 * kk + 2 * t + OFF[e];
            const float cs = cos_row[j], sn = sin_row[j];
            const float2 y = rope_rotate<__nv_bfloat16, HF>(x[kk][e], x[kk + HK][e], sn, cs);
            x[kk][e] = y.x;
            x[kk + HK][e] = y.y;
        }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qa[kk][h] = pack_bf16(x[kk][0], x[kk][1]);
        qa[kk][h + 2] = pack_bf16(x[kk][2], x[kk][3]);
    }
}

}  // namespace flash_detail

// The optional q rotation (ROPE; NORM: with the q norm): inv_freq [D/2] f32, pos_ids [N] (each token's
// RoPE position), g [D], eps. Unused (null views) without ROPE.
struct FlashQRope {
    const float* inv_freq;
    Vec<const int> pos_ids;
    Vec<const __nv_bfloat16> g;
    float eps;
};

template <int D, int G, bool ROPE, bool NORM, bool HF = false>
__device__ __noinline__ void ragged_flash(char* smem, Ten3<const __nv_bfloat16> q, Ten4<const __nv_bfloat16> kc,
                                          Ten4<const __nv_bfloat16> vc, Vec<const int> pos, Vec<const int> slot,
                                          long long N, KvPages pages, float scale,
                                          Ten3<__nv_bfloat16> out, long long c0, long long c1, long long splits,
                                          long long c2, FlashQRope qr) {
    using namespace flash_detail;
    static_assert(D == 64 || D == 128, "ragged_flash: head dim 64 or 128 (blockops/flash_attention.py: HEAD_DIMS)");
    static_assert(G >= 1 && G <= ROWS, "ragged_flash: 1 to 128 query heads a KV head");
    constexpr int BT = ROWS / G;       // tokens a tile
    constexpr int LD = D + 8;          // smem row stride, elements
    constexpr int ROPE_BYTES = ROPE ? 2 * BT * (D / 2) * 4 : 0;  // the tile's cos / sin
    constexpr int BLOCK = block_rows<D, BT>(ROPE_BYTES);  // cache rows a K/V block
    constexpr int KV_BYTES = BLOCK * LD * 2;
    constexpr int S = ring_stages<D, BT>(BLOCK, ROPE_BYTES);  // ring stages
    static_assert(2 * S * KV_BYTES + 3 * BT * 4 + ROPE_BYTES <= MEGA_SMEM, "ragged_flash: the K/V ring does not fit");
    in_global(q, kc, vc, pos, slot, out);
    if (q.s2 != 1 || kc.s3 != 1 || vc.s3 != 1 || out.s2 != 1) {  // (the rewrite gives contiguous heads)
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        return;
    }
    __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem);             // [S][BLOCK][LD]
    __nv_bfloat16* vs = ks + S * BLOCK * LD;                                 // [S][BLOCK][LD]
    int* tpos = reinterpret_cast<int*>(smem + 2 * S * KV_BYTES);            // [BT] the tokens' positions
    int* tslot = tpos + BT;                                                 // [BT] their slots (-1: no token)
    int* tpass = tslot + BT;                                                // [BT] the pass that runs the token
    float* tcos = reinterpret_cast<float*>(tpass + BT);                     // ROPE: [BT][D/2] cos, then sin
    float* tsin = tcos + BT * (D / 2);
    __shared__ int pass_slot, pass_end, bad, bad_set, distinct;  // bad: a bad index's value, once bad_set

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long tok0 = c0 * BT;
    if (tid == 0) bad_set = 0, distinct = 0;
    mega_sync();
    for (int i = tid; i < BT; i += MEGA_THREADS) {
        const long long tk = tok0 + i;
        int p = -1, s = -1;
        if (tk < N) {
            p = pos.p[tk * pos.s0];
            s = slot.p[tk * slot.s0];
            if (p < 0 || p >= pages.rows || s < 0 || s >= pages.slots) flag_bad(bad_set, bad, (p < 0 || p >= pages.rows) ? p : s);
        }
        tpos[i] = p;
        tslot[i] = (tk < N) ? s : -1;
        tpass[i] = -1;
    }
    if (splits > 1) {  // an instance past the tile's passes (a prompt's tile: one) stops here
        mega_sync();
        for (int i = tid; i < BT; i += MEGA_THREADS) {  // the tokens whose slot no earlier token has
            bool first = tslot[i] >= 0;
            for (int j = 0; j < i && first; ++j) first = tslot[j] != tslot[i];
            if (first) atomicAdd(&distinct, 1);
        }
        mega_sync();
        if (bad_set || c2 >= distinct) {  // (uniform)
            if (bad_set && tid == 0) mega_body_error(MEGA_ERR_INDEX, bad);
            return;
        }
    }
    if constexpr (ROPE) {  // (tokens past N: position 0; their q rows are zeros)
#pragma unroll 1
        for (int e = tid; e < BT * (D / 2); e += MEGA_THREADS) {
            const long long tk = tok0 + e / (D / 2);
            const long long p = tk < N ? (long long)ld_cg(qr.pos_ids.p + tk * qr.pos_ids.s0) : 0;
            sincosf(__fmul_rn((float)p, ld_cg(qr.inv_freq + e % (D / 2))), &tsin[e], &tcos[e]);
        }
    }
    mega_sync();
    if (bad_set) {
        if (tid == 0) mega_body_error(MEGA_ERR_INDEX, bad);
        return;  // (uniform: every thread read the same flag)
    }

    // this thread's two rows (g and g + 8 of the warp's m16 tile): token index in the tile and head
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const int i0 = r0 / G, i1 = r1 / G;
    const bool in0 = r0 < BT * G, in1 = r1 < BT * G;
    const long long h0 = c1 * G + r0 % G, h1 = c1 * G + r1 % G;

    // Q fragments, loaded once (rows past N or past the tile: zeros)
    unsigned qa[D / 16][4];
    {
        const bool v0 = in0 && tok0 + i0 < N, v1 = in1 && tok0 + i1 < N;
        const __nv_bfloat16* q0 = q.p + (tok0 + i0) * q.s0 + h0 * q.s1;
        const __nv_bfloat16* q1 = q.p + (tok0 + i1) * q.s0 + h1 * q.s1;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int d = 16 * kk + 2 * t;
            qa[kk][0] = v0 ? __ldcg(reinterpret_cast<const unsigned*>(q0 + d)) : 0u;
            qa[kk][1] = v1 ? __ldcg(reinterpret_cast<const unsigned*>(q1 + d)) : 0u;
            qa[kk][2] = v0 ? __ldcg(reinterpret_cast<const unsigned*>(q0 + d + 8)) : 0u;
            qa[kk][3] = v1 ? __ldcg(reinterpret_cast<const unsigned*>(q1 + d + 8)) : 0u;
        }
        if constexpr (ROPE) {  // (rotating while the first K/V blocks load instead took the D = 128 normalising
                               // body to 255 registers)
            const int i0c = in0 ? i0 : 0, i1c = in1 ? i1 : 0;  // (rows past the tile: zeros, any rotation)
            rope_q_row<D, NORM, HF>(qa, 0, tcos + i0c * (D / 2), tsin + i0c * (D / 2), t, qr.g, qr.eps);
            rope_q_row<D, NORM, HF>(qa, 1, tcos + i1c * (D / 2), tsin + i1c * (D / 2), t, qr.g, qr.eps);
        }
    }
    const float sl2 = scale * 1.4426950408889634f;  // scores in base 2

    for (int pass = 0;; ++pass) {
        // thread 0: the first token no pass has run picks the slot; every token in that slot joins
        if (tid == 0) {
            int s = -1, end = 0;
            for (int i = 0; i < BT; ++i) {
                if (tslot[i] < 0 || tpass[i] >= 0) continue;
                if (s < 0) s = tslot[i];
                if (tslot[i] == s) {
                    tpass[i] = pass;
                    end = max(end, tpos[i] + 1);
                }
            }
            pass_slot = s;
            pass_end = end;
        }
        mega_sync();
        const int s = pass_slot, end = pass_end;
        if (s < 0) break;
        if (pass % splits != c2) {  // another instance of the tile runs it (blockops/flash_attention.py: splits)
            mega_sync();  // (the pass slot is rewritten next)
            continue;
        }
        const bool a0 = in0 && tpass[i0] == pass, a1 = in1 && tpass[i1] == pass;
        const int p0 = a0 ? tpos[i0] : -1, p1 = a1 ? tpos[i1] : -1;  // the last cache row each row attends
        const int warp_last = __reduce_max_sync(0xffffffffu, max(p0, p1));  // (-1: the warp has no row here)
        // the earliest last row of the warp's rows in this pass: blocks that end by it need no mask. Rows of
        // other passes, past N or past the tile (p = -1) are left out of it: unmasked they hold garbage
        // sums, but no step mixes rows (the MMAs and the quad shuffles keep each row its own) and they
        // are never stored; where masking runs they are masked whole.
        const int warp_first_end = __reduce_min_sync(0xffffffffu, min(a0 ? p0 : 0x7fffffff, a1 ? p1 : 0x7fffffff));
        const int nblocks = (end + BLOCK - 1) / BLOCK;

        // K/V block b -> stage b % S: 16-byte cp.async chunks, rows past `end` zero-filled. A thread copies
        // the same column of rows row0, row0 + RSTEP, ... of K and of V in every block. A paged cache's row
        // is found through the page table (kv_pages.cuh: kv_row; a page outside the pool: zeros, and the
        // error reported after the passes).
        constexpr int CPR = D / 8;                  // chunks a cache row
        constexpr int RSTEP = MEGA_THREADS / CPR;  // rows between a thread's chunks
        static_assert(MEGA_THREADS % CPR == 0 && BLOCK % RSTEP == 0, "ragged_flash: whole rows of chunks a pass of threads");
        const int row0 = tid / CPR, col0 = (tid % CPR) * 8;
        auto issue = [&](int b) {
            if (b < nblocks) {
                __nv_bfloat16* kd = ks + (b % S) * BLOCK * LD + row0 * LD + col0;
                __nv_bfloat16* vd = vs + (b % S) * BLOCK * LD + row0 * LD + col0;
#pragma unroll
                for (int i = 0; i < BLOCK / RSTEP; ++i) {
                    const int kv = b * BLOCK + row0 + i * RSTEP;
                    long long page = s, row = kv;  // (one table load a row for a paged cache)
                    bool ok = kv < end;
                    if (ok && !kv_locate(pages, s, kv, page, row)) flag_bad(bad_set, bad, (int)page), ok = false;
                    if (!ok) page = s, row = 0;  // (a zero fill reads nothing; the address stays inside the cache)
                    cp_async16(kd + i * RSTEP * LD, kc.p + page * kc.s0 + c1 * kc.s1 + row * kc.s2 + col0, ok ? 16 : 0);
                    cp_async16(vd + i * RSTEP * LD, vc.p + page * vc.s0 + c1 * vc.s1 + row * vc.s2 + col0, ok ? 16 : 0);
                }
            }
            cp_async_commit();  // (an empty group past the last block keeps the wait counts uniform)
        };

        float o[D / 8][4];
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m0 = MEGA_NEG_INF, m1 = MEGA_NEG_INF, l0 = 0.0f, l1 = 0.0f;

        for (int b = 0; b < S - 1; ++b) issue(b);
        for (int b = 0; b < nblocks; ++b) {
            cp_async_wait<S - 2>();  // block b landed (this thread's chunks) ...
            mega_sync();             // ... and the block's; and every warp is done with block b - 1
            issue(b + S - 1);        // (into block b - 1's stage)
            const __nv_bfloat16* kb = ks + (b % S) * BLOCK * LD;
            const __nv_bfloat16* vb = vs + (b % S) * BLOCK * LD;
            if (warp_last >= b * BLOCK) {  // (causal: a warp whose rows all end before the block skips it)
                // S = Q K^T for this warp's 16 rows x 64 cache rows
                float sc[BLOCK / 8][4];
#pragma unroll
                for (int n = 0; n < BLOCK / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
                    for (int j = 0; j < BLOCK / 8; j += 2) {
                        // matrices: (rows 8j.., d 16kk..), (8j.., 16kk+8..), (8j+8.., 16kk..), (8j+8.., 16kk+8..)
                        const int mi = lane >> 3, row = 8 * (j + (mi >> 1)) + (lane & 7), col = 16 * kk + 8 * (mi & 1);
                        unsigned kb4[4];
                        ldmatrix_x4(kb4, kb + row * LD + col);
                        mma16816a(sc[j], qa[kk], kb4[0], kb4[1]);
                        mma16816a(sc[j + 1], qa[kk], kb4[2], kb4[3]);
                    }
                }
                // mask (past the row's position, or not this pass's row) where a row of the warp ends inside
                // the block, and the running max (scores unscaled: the scale goes into the exponent's FMA)
                if ((b + 1) * BLOCK - 1 > warp_first_end) {
#pragma unroll
                    for (int n = 0; n < BLOCK / 8; ++n) {
                        const int kv = b * BLOCK + 8 * n + 2 * t;
                        if (kv > p0) sc[n][0] = MEGA_NEG_INF;
                        if (kv + 1 > p0) sc[n][1] = MEGA_NEG_INF;
                        if (kv > p1) sc[n][2] = MEGA_NEG_INF;
                        if (kv + 1 > p1) sc[n][3] = MEGA_NEG_INF;
                    }
                }
                float mx0 = MEGA_NEG_INF, mx1 = MEGA_NEG_INF;
#pragma unroll
                for (int n = 0; n < BLOCK / 8; ++n) {
                    mx0 = fmaxf(mx0, fmaxf(sc[n][0], sc[n][1]));
                    mx1 = fmaxf(mx1, fmaxf(sc[n][2], sc[n][3]));
                }
#pragma unroll
                for (int x = 1; x <= 2; x <<= 1) {
                    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
                    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
                }
                const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
                // the new max in base-2 units (0 while no score is seen: every exponent then -inf)
                const float u0 = n0 == MEGA_NEG_INF ? 0.0f : n0 * sl2, u1 = n1 == MEGA_NEG_INF ? 0.0f : n1 * sl2;
                const float al0 = exp2f_fast(fmaf(m0, sl2, -u0)), al1 = exp2f_fast(fmaf(m1, sl2, -u1));
                m0 = n0;
                m1 = n1;
                l0 *= al0;
                l1 *= al1;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[n][0] *= al0;
                    o[n][1] *= al0;
                    o[n][2] *= al1;
                    o[n][3] *= al1;
                }
                // P (bf16 A fragments, 16 cache rows each) and O += P V
#pragma unroll
                for (int kk = 0; kk < BLOCK / 16; ++kk) {
                    float p[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        p[h][0] = exp2f_fast(fmaf(sc[2 * kk + h][0], sl2, -u0));
                        p[h][1] = exp2f_fast(fmaf(sc[2 * kk + h][1], sl2, -u0));
                        p[h][2] = exp2f_fast(fmaf(sc[2 * kk + h][2], sl2, -u1));
                        p[h][3] = exp2f_fast(fmaf(sc[2 * kk + h][3], sl2, -u1));
                        l0 += p[h][0] + p[h][1];
                        l1 += p[h][2] + p[h][3];
                    }
                    const unsigned pa[4] = {pack_bf16(p[0][0], p[0][1]), pack_bf16(p[0][2], p[0][3]),
                                            pack_bf16(p[1][0], p[1][1]), pack_bf16(p[1][2], p[1][3])};
#pragma unroll
                    for (int dp = 0; dp < D / 16; ++dp) {
                        // matrices: (rows 16kk.., d 16dp..), (16kk+8.., 16dp..), (16kk.., 16dp+8..), (16kk+8.., 16dp+8..)
                        const int mi = lane >> 3, row = 16 * kk + 8 * (mi & 1) + (lane & 7), col = 16 * dp + 8 * (mi >> 1);
                        unsigned vb4[4];
                        ldmatrix_x4_trans(vb4, vb + row * LD + col);
                        mma16816a(o[2 * dp], pa, vb4[0], vb4[1]);
                        mma16816a(o[2 * dp + 1], pa, vb4[2], vb4[3]);
                    }
                }
            }
        }
        cp_async_wait<0>();
        mega_sync();  // every warp is done with the ring before the next pass refills it

        // the rows' sums (the four threads of a row hold parts), then out = O / l
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, x);
            l1 += __shfl_xor_sync(0xffffffffu, l1, x);
        }
        const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        __nv_bfloat16* o0 = out.p + (tok0 + i0) * out.s0 + h0 * out.s1;
        __nv_bfloat16* o1 = out.p + (tok0 + i1) * out.s0 + h1 * out.s1;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int d = 8 * n + 2 * t;
            if (a0) *reinterpret_cast<__nv_bfloat162*>(o0 + d) = __floats2bfloat162_rn(o[n][0] * inv0, o[n][1] * inv0);
            if (a1) *reinterpret_cast<__nv_bfloat162*>(o1 + d) = __floats2bfloat162_rn(o[n][2] * inv1, o[n][3] * inv1);
        }
        mega_sync();  // (the pass slot is rewritten next)
    }
    if (bad_set && threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, bad);  // (a page outside the pool)
}
