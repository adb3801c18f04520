// The megakernel: a persistent interpreter over the symbolic work queue.
//
// Every block (one per SM) loops: claim the next instance (one atomic, queue
// order), find its entry, wait for its input barriers (acquire), run the inlined
// block-op body, signal its output barriers (release). Launch counts, offsets,
// barrier indices and expected counts are expressions of the runtime dims in
// args.dims, evaluated here, so a new position needs no rebuild.
//
// Entries whose code differs only in constants (the same op in every layer) share one
// `case`; the entry table (args.table) gives each entry its case and its own constants
// E[0..] (arena offsets, pointer slots, counter bases), so the code does not grow with
// the number of layers.
//
// Counters come in two parity sets: a launch uses set `parity` and zeroes the
// other one (and its claim counter) for the next launch, so no host reset is needed.
//
// A tensor-parallel kernel (one per GPU, the same code) also has a peer region per rank, which
// every rank writes into over NVLink: the peer counters, which count across launches (a wait
// expects `seq` times its count), and the peer buffers, in two halves by the parity of `seq`
// (docs/parallel.md).
#define MEGA_MAX_WAITS /*@MAXWAITS@*/  // the most barrier waits of one queue entry
#ifndef MEGA_REGIME
#define MEGA_REGIME -1  // a program with row regimes: the one regime whose cases this image holds (render.py)
#endif
#define MEGA_MAX_SIGNALS /*@MAXSIGNALS@*/  // the most barrier sets one entry signals
#define MEGA_PEERS /*@PEERS@*/  // 1: a tensor-parallel kernel (peer counters, waits at system scope)
#include "runtime.cuh"
#include "common.cuh"
/*@INCLUDES@*/

#ifndef MEGA_PEER_FENCE
// 1: a system-scope fence before the peer signals, besides their release. Off: the signalling
// thread's red.release.sys, after the block barrier, orders the block's peer stores (release is
// cumulative over bar.sync; docs/parallel.md); a TP=2 step measured 3% faster (perf-notes #54).
#define MEGA_PEER_FENCE 0
#endif

#define MEGA_ENTRIES /*@ENTRIES@*/
#define MEGA_COUNTERS /*@COUNTERS@*/
#define MEGA_LAUNCHES /*@LAUNCHES@*/  // distinct launch counts that are runtime expressions
#define MEGA_CONSTS_AT (2 * MEGA_ENTRIES + (1 + MEGA_LAUNCHES) * (MEGA_ENTRIES + 1))  // table: the constants
// An image of one band of a row regime (interpreter/render.py: image_defines) holds the band's entries
// only, [MEGA_ENTRY0, MEGA_ENTRY0 + MEGA_IMAGE_ENTRIES) of the queue: its tables are static shared memory,
// and shared memory beyond the carve-out the image needs is L1 the bodies lose (perf-notes #88).
#ifndef MEGA_ENTRY0
#define MEGA_ENTRY0 0
#define MEGA_IMAGE_ENTRIES MEGA_ENTRIES
#endif
#define MEGA_MAX_RANKS 8  // GPUs of a tensor-parallel group (megaegg/ops.py: MAX_RANKS)

// struct MegaArgs, the by-value argument struct, and the static_asserts of its layout: interpreter/kernel_args.py
/*@ARGS@*/

extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) megakernel(const __grid_constant__ MegaArgs args) {
  extern __shared__ __align__(16) char smem[];
  __shared__ long long prefix[MEGA_IMAGE_ENTRIES + 1];  // (image-local entries: queue entry MEGA_ENTRY0 + e)
  __shared__ int entry_case[MEGA_IMAGE_ENTRIES + 1], entry_consts[MEGA_IMAGE_ENTRIES + 1];  // (+1: a queue may be empty)
  __shared__ long long claimed;
  __shared__ int claimed_entry;  // the entry of this block's last claim (claims only grow), thread 0's, handed over
  /*@DEFERRED_SHARED@*/

  unsigned long long* control = args.control;
  const int parity = (int)args.parity;
  unsigned* ctr = args.counters + (parity ? MEGA_COUNTERS : 0);
  const long long D_rank = args.rank;
  (void)D_rank;
  /*@PEER@*/
  /*@DIMS@*/

  if (threadIdx.x == 0) {
    mega_control_ptr = control;
    mega_abort_block = 0;
    // (here, before the prologue's barrier: set in a branch of its own before the loop, ptxas made the loop's
    // barrier a second entry point and warp 0 reached the claim's __syncthreads split: wrong outputs, perf-notes #108)
    claimed_entry = 0;
  }
  {  // the first instance of every entry, from the table (render.py: LaunchPrefix), less the image's first
    const long long launch[MEGA_LAUNCHES] = {/*@LAUNCH_VALUES@*/};
    const long long* base = args.table + 2 * MEGA_ENTRIES;
    auto first = [&](int e) {
      long long p = base[e];
#pragma unroll
      for (int j = 0; j < MEGA_LAUNCHES; ++j) p += base[(j + 1) * (MEGA_ENTRIES + 1) + e] * launch[j];
      return p;
    };
    const long long p0 = MEGA_ENTRY0 ? first(MEGA_ENTRY0) : 0;  // (0 in a band's launch: the bands before launch nothing)
    for (int e = threadIdx.x; e <= MEGA_IMAGE_ENTRIES; e += blockDim.x) prefix[e] = first(MEGA_ENTRY0 + e) - p0;
  }
  for (int e = threadIdx.x; e < MEGA_IMAGE_ENTRIES; e += blockDim.x) {
    entry_case[e] = (int)args.table[MEGA_ENTRY0 + e];
    entry_consts[e] = (int)args.table[MEGA_ENTRIES + MEGA_ENTRY0 + e];
  }
  {  // zero the other parity's counters and claim counter for the next launch
    unsigned* next = args.counters + (parity ? 0 : MEGA_COUNTERS);
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < MEGA_COUNTERS;
         k += (long long)gridDim.x * blockDim.x)
      next[k] = 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) control[1 - parity] = 0;
  }
  __syncthreads();
  const long long total = prefix[MEGA_IMAGE_ENTRIES];
  auto find_entry = [&](long long g, int lo) {  // image entry e >= lo holds instances [prefix[e], prefix[e+1])
    int hi = MEGA_IMAGE_ENTRIES - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (prefix[mid] <= g) lo = mid; else hi = mid - 1;
    }
    return lo;
  };

  for (;;) {
    // Which instance runs, in the shared error record too (bodies report errors from any thread). It is
    // written before a barrier, so no thread still reads the previous instance's (racecheck).
#ifdef MEGA_TRACE
    long long c_issue = 0, c_signal = 0;
#endif
    if (threadIdx.x == 0) {  // claim the next instance in queue order (or stop: another block failed)
#ifdef MEGA_TRACE
      c_issue = clock64();
      mega_c_poll = mega_c_mark = 0;
#endif
      // the claim and the abort check are both in flight, not one after the other (perf-notes #62; a
      // claim past an abort runs nothing, and the next launch starts from the other parity's counter)
      const long long c = (long long)atomicAdd(&control[parity], 1ULL);
      claimed = *(volatile unsigned long long*)&control[2] ? total : c;
      if (claimed < total) {  // its entry: this block's last one or one a step or two on, mostly
        int e = claimed_entry;
        for (int k = 0; k < 4 && prefix[e + 1] <= claimed; ++k) ++e;
        if (prefix[e + 1] <= claimed) e = find_entry(claimed, e + 1);
        claimed_entry = e;
        mega_cur_entry = MEGA_ENTRY0 + e;  // (the queue's entry, for error records)
        mega_cur_instance = claimed - prefix[e];
      }
    }
    __syncwarp();  // (warp 0 whole at the barrier, whatever layout ptxas picks)
    __syncthreads();
    const long long g = claimed;
    if (g >= total) break;
    const int entry = claimed_entry;
    const long long local = g - prefix[entry];
#ifdef MEGA_TRACE
    unsigned long long t_claim = mega_globaltimer(), t_waited = 0;
    const long long c_claim = clock64();
    long long c_waited = 0;
#endif
    const long long* E = args.table + MEGA_CONSTS_AT + entry_consts[entry];  // this entry's constants
    (void)E;
    if (threadIdx.x == 32 && entry + 1 < MEGA_IMAGE_ENTRIES) {  // the next entry's constants into L1: its first
      const long long* next = args.table + MEGA_CONSTS_AT + entry_consts[entry + 1];  // instance here finds them
      asm volatile("prefetch.global.L1 [%0];" :: "l"(next));
      asm volatile("prefetch.global.L1 [%0];" :: "l"(next + 15));  // (in the table: render.py PREFETCH_PAD)
    }
    /*@DEFERRED_DECL@*/
    switch (entry_case[entry]) {
/*@CASES@*/
      default: break;
    }
    // the deferred kinds' bodies (render.py: deferred_slots): one inlined copy each, whichever entry ran
    /*@DEFERRED_RUN@*/
    mega_sync();
#ifdef MEGA_TRACE
    if (threadIdx.x == 0) {
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      unsigned long long* rec = args.trace + MEGA_TRACE_WORDS * g;  // (interpreter/trace.py: Trace.records)
      rec[0] = ((unsigned long long)(MEGA_ENTRY0 + entry) << 40) | ((unsigned long long)smid << 32) | (unsigned long long)local;
      rec[1] = t_claim;
      rec[2] = t_waited ? t_waited : t_claim;
      rec[3] = mega_globaltimer();
      const long long c[] = {c_issue, c_claim, mega_c_poll, c_waited ? c_waited : c_claim, mega_c_mark, c_signal, clock64()};
      for (int i = 0; i < (int)(sizeof(c) / sizeof(c[0])); ++i) rec[4 + i] = (unsigned long long)c[i];
    }
#endif
    if (mega_abort_block) break;
  }
}
