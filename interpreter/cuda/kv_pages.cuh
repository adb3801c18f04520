// Where a sequence's cache rows are (blockops/kv_store.py: CacheRows, kv_pages): row p of sequence s is
// cache[s, :, p], or in a paged cache (a pool of pages) row p % page_len of page table[s, p / page_len].
#pragma once
#include "common.cuh"

// A cache's geometry (blockops/kv_store.py: kv_pages): a cache of `slots` sequences of `rows` rows, or a
// pool of `count` pages of `page_len` rows read through the page table (table.p == nullptr: no table;
// then page_len = rows and count = slots).
struct KvPages {
    Mat<const int> table;
    long long slots, rows, page_len, count;
};

// The (page, row) of sequence s's position p (s and p checked by the caller): s and p themselves, or through
// the page table; false for a page outside the pool (page: its index).
__device__ __forceinline__ bool kv_locate(const KvPages& pg, long long s, long long p, long long& page, long long& row) {
    page = s, row = p;
    if (pg.table.p == nullptr) return true;
    page = ld_cg(pg.table.p + s * pg.table.s0 + (p / pg.page_len) * pg.table.s1);
    row = p % pg.page_len;
    return page >= 0 && page < pg.count;
}

// Element offset of KV head h's row of sequence s at position p in a cache of strides cs0..cs2, or -1 for a
// page outside the pool (*bad: its index).
__device__ __forceinline__ long long kv_row(const KvPages& pg, long long cs0, long long cs1, long long cs2, long long s,
                                            long long p, long long h, long long* bad) {
    long long page, row;
    if (!kv_locate(pg, s, p, page, row)) {
        *bad = page;
        return -1;
    }
    return page * cs0 + h * cs1 + row * cs2;
}
