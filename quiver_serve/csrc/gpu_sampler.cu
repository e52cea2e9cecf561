// Neighbour sampling (docs/architecture.md, "Sampling") on the GPU: one persistent kernel per
// batch.
//
// Compiled at run time by CuPy (NVRTC, no headers) and launched from
// quiver_serve/sampling/gpu.py. The output must equal quiver_serve/sampling/reference.py bit for
// bit, so the counter-based random numbers below are the ones of sampling/base.py.
//
// Why one kernel: a 1-node batch does a few hundred loads, so a launch per step (count, scan,
// fill, dedup, relabel, per hop) would spend its whole budget on launch latency. Instead the
// phases of a batch run in one cooperative launch and meet at grid barriers; a small batch gets
// one block, where a grid barrier is a plain __syncthreads.
//
// De-duplication uses `state`, an int32 per graph node that is STATE_EMPTY between batches:
//   >= 0  during a hop: the smallest hop-local edge position at which the node appeared
//         (atomicMin), i.e. its first occurrence;
//   <  0  the node already has a row in n_id: state == -(local_id + 1).
// Positions are hop-local and every hop ends with all its nodes negative, so candidates of
// different hops never meet. The batch resets the entries it touched before it returns.
//
// Output buffer `out` (int64), sized by the host from upper bounds:
//   [0, n_cap)                  n_id
//   [n_cap, n_cap + 2 e_cap)    edges: rows [0, E) then cols [E, 2E), i.e. a contiguous [2, E]
//   next num_seeds              seed_index
// `counts` (5 + 2L int64, pinned host memory mapped into the GPU, so the host reads it after the
// stream sync without a copy): status, need_n, need_e_hop, need_e_total, nodes per hop (L + 1),
// edges per hop (L).
//
// The living graph (quiver_serve/graph/overlay_view.py): with an overlay (P_OV_START non-null),
// node v's list is its counted base list (v < n_base and not REPLACED: its first B - cut entries,
// a place named by one of its override pairs reading the pair's value), then its tail in the
// overlay's int64 `tail` (device memory in both modes; the block at ov_start[v] holds the cut's
// pairs, then the tail); entry q of that combined list is what a draw at offset q reads, so
// sampling is the reference's over the same lists. Without one, every tail is
// empty and nothing below reads the overlay.

typedef long long i64;
typedef unsigned int u32;
typedef unsigned long long u64;
// Elias-Fano adjacency cache offsets (sampling/graph_cache/elias_fano.py): block word | l << EF_L_SHIFT
#define EF_L_SHIFT 58
#define EF_OFFSET_MASK ((1LL << EF_L_SHIFT) - 1)
// ... and the list's length in 27 bits (the host leaves longer lists out of this layout)
#define EF_DEG_BITS 27
#define EF_DEG_MASK ((1u << EF_DEG_BITS) - 1u)

#ifndef SAMPLER_THREADS
#define SAMPLER_THREADS 1024
#endif
#define FULL_MASK 0xffffffffu
#define STATE_EMPTY 0x7fffffff
#define STATUS_OK 0
#define STATUS_OVERFLOW 1
#define STATUS_BAD_SEED 2
#define COUNTS_HEADER 4
// overlay_view.REPLACED, LENGTH_MASK, CUT_SHIFT and CUT_MASK
#define OV_REPLACED (1LL << 62)
#define OV_LENGTH_MASK ((1LL << 32) - 1)
#define OV_CUT_SHIFT 32
#define OV_CUT_MASK ((1LL << 30) - 1)

// Data written inside the kernel by one block and read by another goes through L2 (ld.cg):
// an SM's L1 is not coherent with the other SMs' stores.
#define LOAD(ptr) __ldcg(ptr)

// The batch's parameters arrive as one block of int64 in pinned host memory (mapped): the 27
// P_* below in their order, then the fanouts. One launch argument instead of 20 saves about
// 10 us of CuPy's per-argument work on the host for every batch, for one bus read per block here.
#define NUM_PARAMS 27
#define MAX_HOPS 32

#ifndef SAMPLER_EMU  // (a CPU emulation of this file, used in development, supplies its own)
// Shared scratch for block scans and reductions (66 words used).
__device__ __forceinline__ i64* block_scratch() {
    __shared__ i64 scratch[72];
    return scratch;
}

__device__ __forceinline__ i64* block_params() {
    __shared__ i64 params[NUM_PARAMS + MAX_HOPS];
    return params;
}
#endif

// ---- counter-based random numbers (the twins of base.mix32 / node_hash / draw32) -------------

__device__ __forceinline__ u32 mix32(u32 x) {
    x = ((x >> 16) ^ x) * 0x45D9F3Bu;
    x = ((x >> 16) ^ x) * 0x45D9F3Bu;
    return (x >> 16) ^ x;
}

__device__ __forceinline__ u32 node_hash(u32 base, i64 hop, i64 node) {
    return mix32(base ^ mix32((u32)node + 0x632BE5ABu * (u32)hop));
}

__device__ __forceinline__ u32 draw32(u32 node_h, i64 draw) {
    return mix32(node_h ^ ((u32)draw * 0x85EBCA6Bu));
}

// ---- block and grid cooperation -----------------------------------------------------------------

__device__ __forceinline__ i64 warp_inclusive_scan(i64 x, int lane) {
    for (int d = 1; d < 32; d <<= 1) {
        i64 y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane >= d) x += y;
    }
    return x;
}

// Exclusive prefix sum of x over the block; *total receives the block's sum.
// Every thread of the block must call it (it synchronises the block).
__device__ i64 block_exclusive_scan(i64 x, i64* total) {
    i64* warp_sums = block_scratch();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    const i64 incl = warp_inclusive_scan(x, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const i64 w = lane < num_warps ? warp_sums[lane] : 0;
        const i64 w_incl = warp_inclusive_scan(w, lane);
        if (lane < num_warps) warp_sums[lane] = w_incl - w;
        if (lane == 31) warp_sums[32] = w_incl;
    }
    __syncthreads();
    const i64 result = warp_sums[warp] + incl - x;
    *total = warp_sums[32];
    __syncthreads();  // the next call reuses warp_sums
    return result;
}

#define TOP_BIT 0x80000000u

#ifndef SAMPLER_EMU
__device__ __forceinline__ u32 atomic_add_release(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
#endif

// All blocks of the launch meet here (co-residency is what the cooperative launch guarantees; with
// one block this is a plain __syncthreads). One atomic per block: block 0 adds 2^31 - (G - 1) and
// the others 1, so the word's top bit flips exactly when the last block arrives and its low bits
// are back where they started, ready for the next barrier without a reset (the scheme of
// cooperative_groups' grid sync). The release/acquire pair publishes each block's writes (ordered
// before it by __syncthreads) to every block that leaves the barrier. (8-12 us per batch faster
// than an arrival counter plus generation word with __threadfence and back-off.)
__device__ void grid_sync(u32* barrier) {
    __syncthreads();
    if (gridDim.x == 1) return;
    if (threadIdx.x == 0) {
        const u32 add = blockIdx.x == 0 ? TOP_BIT - (gridDim.x - 1) : 1u;
        const u32 before = atomic_add_release(barrier, add);
        while (((before ^ load_acquire(barrier)) & TOP_BIT) == 0) {
        }
    }
    __syncthreads();
}

// Block b's contiguous share [lo, hi) of n items; every phase that needs a grid-wide scan
// partitions statically like this, so the scan is "sum of earlier blocks + block-local scan".
__device__ __forceinline__ void block_range(i64 n, i64* lo, i64* hi) {
    const i64 per = (n + gridDim.x - 1) / gridDim.x;
    const i64 start = per * (i64)blockIdx.x;
    *lo = start < n ? start : n;
    *hi = *lo + per < n ? *lo + per : n;
}

__device__ __forceinline__ i64 warp_sum(i64 x) {
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(FULL_MASK, x, d);
    return x;
}

// Sum of block_sums over the blocks before this one (*carry) and over all blocks (*total);
// `mine` is this block's own entry, which is all there is in a one-block grid.
// Every thread of the block must call it.
__device__ void grid_carry(const i64* block_sums, i64 mine, i64* carry, i64* total) {
    if (gridDim.x == 1) {
        *carry = 0;
        *total = mine;
        return;
    }
    i64* partial = block_scratch();  // [0, 32): before, [32, 64): all -- needs 64 words
    i64 before = 0, all = 0;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        const i64 v = LOAD(block_sums + b);
        all += v;
        if (b < (int)blockIdx.x) before += v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    before = warp_sum(before);
    all = warp_sum(all);
    if (lane == 0) {
        partial[warp] = before;
        partial[32 + warp] = all;
    }
    __syncthreads();
    if (warp == 0) {
        const bool used = lane < (int)(blockDim.x >> 5);
        before = warp_sum(used ? partial[lane] : 0);
        all = warp_sum(used ? partial[32 + lane] : 0);
        if (lane == 0) {
            partial[64] = before;
            partial[65] = all;
        }
    }
    __syncthreads();
    *carry = partial[64];
    *total = partial[65];
    __syncthreads();  // the next user of the scratch
}

// ---- one frontier node ----------------------------------------------------------------------------

// A neighbour list's entries, read by expand_node: int64 (bits == 64: the CSC, in GPU or pinned
// host memory, or an adjacency cache of index_bits = 64), or the adjacency cache's bit-packed
// lists (sampling/graph_cache/adjacency.py): entry q is `bits` (1-32) bits at bit q * bits of little-endian
// 32-bit words, read as the 64-bit window of its word and the next (the host pads the array by
// one word). Holding only the bits node ids need (18 on a Reddit-sized graph) puts 3.6x the
// lists of int64 in the same GPU memory. One type for every layout (a branch the whole warp takes the
// same way) rather than a template per layout: two copies of expand_node spilled more. bits == 0:
// an Elias-Fano list (ef_entry).
struct ListReader {
    const void* base;
    u32 bits;  // 64, 1-32, or 0: one Elias-Fano list (base: its block; see ef_entry)
    u32 ef;    // Elias-Fano: the list's length | l << EF_DEG_BITS
    __device__ __forceinline__ i64 operator[](i64 q) const {
        if (bits == 64) {
            const i64* __restrict__ entries = (const i64*)base;
            return entries[q];
        }
        if (bits == 0) return ef_entry((const u32*)base, ef >> EF_DEG_BITS, ef & EF_DEG_MASK, (u32)q);
        const u32* __restrict__ words = (const u32*)base;
        const u64 bit = (u64)q * bits;
        const u64 j = bit >> 5;
        const u64 window = ((u64)words[j + 1] << 32) | (u64)words[j];
        return (i64)((window >> (bit & 31)) & ((1ull << bits) - 1ull));
    }
    // Entry q of an Elias-Fano list (sampling/graph_cache/elias_fano.py): block = [ceil(deg/64) samples |
    // ceil(deg*l/32) low-bit words | upper bits]. The high part is the position of set bit q of
    // the upper bits minus q, found from the sample of q's group of 64 (the position of its
    // first set bit) by a short scan; the low l bits are packed as in the layout above.
    static __device__ __forceinline__ i64 ef_entry(const u32* __restrict__ w, u32 l, u32 d, u32 q) {
        const u32 num_samples = (d + 63) >> 6;
        const u32 num_low = (u32)(((u64)d * l + 31) >> 5);
        const u32* __restrict__ upper = w + num_samples + num_low;
        const u32 pos = w[q >> 6];
        u32 need = q & 63;  // set bits to pass after the sample's own
        u32 wi = pos >> 5;
        u32 word = upper[wi] & (~0u << (pos & 31));
        for (u32 c = __popc(word); need >= c; c = __popc(word)) {
            need -= c;
            word = upper[++wi];
        }
        for (; need; --need) word &= word - 1;
        const u64 high = (u64)((wi << 5) + (u32)(__ffs(word) - 1) - q);
        if (l == 0) return (i64)high;
        const u64 bit = (u64)q * l;
        const u32* __restrict__ low = w + num_samples;
        const u64 window = ((u64)low[(bit >> 5) + 1] << 32) | (u64)low[bit >> 5];
        return (i64)((high << l) | ((window >> (bit & 31)) & ((1ull << l) - 1ull)));
    }
};

// Records neighbour u at hop-local position p and proposes p as u's first occurrence.
__device__ __forceinline__ void emit_edge(i64 p, i64 u, int owner, i64* rows, int* cols, int* state) {
    rows[p] = u;
    cols[p] = owner;
    // A known node (negative) or an earlier position already wins; skip the atomic then,
    // which keeps hub nodes that appear in thousands of lists from serialising on one word.
    if (LOAD(state + u) > (int)p) atomicMin(state + u, (int)p);
}

// One warp writes Floyd's k-of-deg choices (deg > k) for node v, in draw order, as offsets into
// its list at rows[p0 .. p0 + k): draw i's candidate is computed by lane i % 32 in parallel; the
// test against the earlier choices is a warp vote per draw (k is small, so scanning the node's
// chosen slots beats any hash set). Lane i % 32 writes draw i, and only it reads it back.
// (Slower: a warp first choosing positions for a chunk of nodes and then resolving all its edges
// lane-parallel; it needs more registers than the 64 available.)
__device__ void draw_offsets(i64 v, i64 deg, i64 k, i64 hop, u32 base, i64 p0, i64* rows,
                             int lane) {
    // Degrees and offsets fit in 32 bits (hop-local positions are int32 already); 32-bit
    // arithmetic keeps register pressure down.
    const u32 node_h = node_hash(base, hop, v);
    const int num_draws = (int)k, first_t = (int)(deg - k);
    for (int round = 0; round < num_draws; round += 32) {
        const int i = round + lane;
        const int t = first_t + i;
        int cand = 0;
        if (i < num_draws) cand = (int)(((u64)draw32(node_h, i) * (u64)(t + 1)) >> 32);
        int chosen = -1;
        const int in_round = num_draws - round < 32 ? num_draws - round : 32;
        for (int s = 0; s < in_round; ++s) {
            const int c = __shfl_sync(FULL_MASK, cand, s);
            bool taken = lane < s && chosen == c;
            // Choices of earlier rounds (k > 32 only) wait in rows[] as offsets.
            for (int q = lane; q < round; q += 32) taken |= rows[p0 + q] == c;
            const u32 any_taken = __ballot_sync(FULL_MASK, taken);
            if (lane == s) chosen = any_taken ? t : c;
        }
        if (i < num_draws) rows[p0 + i] = chosen;
        __syncwarp();
    }
}

// ---- the batch ------------------------------------------------------------------------------------

// Ranks the first occurrences among ids[lo, hi) (the block's share): id ids[i] occurs first at i
// when state[ids[i]] == i. rank_buf[i] = block-local rank, or -1. Returns the block's count.
// Every thread of the block must call it. (Several items per thread measured slower.)
__device__ i64 rank_first_occurrences(const i64* ids, i64 lo, i64 hi, const int* state,
                                      int* rank_buf) {
    i64 ranked = 0;
    for (i64 c = lo; c < hi; c += blockDim.x) {
        const i64 i = c + threadIdx.x;
        i64 first = 0;
        if (i < hi) first = LOAD(state + LOAD(ids + i)) == (int)i;
        i64 chunk_total;
        const i64 r = block_exclusive_scan(first, &chunk_total);
        if (i < hi) rank_buf[i] = first ? (int)(ranked + r) : -1;
        ranked += chunk_total;
    }
    return ranked;
}

// Gives the ranked first occurrences of [lo, hi) their rows n_id[row0 + rank].
__device__ void assign_rows(const i64* ids, i64 lo, i64 hi, i64 row0, const int* rank_buf,
                            i64* n_id, int* state) {
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const int r = LOAD(rank_buf + i);
        if (r >= 0) {
            const i64 row = row0 + r;
            const i64 u = LOAD(ids + i);
            n_id[row] = u;
            state[u] = -(int)(row + 1);
        }
    }
}

// Rewrites the global ids in rows[lo, hi) as rows (local ids).
__device__ void relabel(i64* rows, i64 lo, i64 hi, const int* state) {
    for (i64 p = lo + threadIdx.x; p < hi; p += blockDim.x)
        rows[p] = -(i64)LOAD(state + LOAD(rows + p)) - 1;
}

// Block-local exclusive offsets of the frontier's edge counts; returns the block's edge count.
// Each node's CSC range goes to front_csc so that the draw phase does not read indptr again
// (with UVA every indptr read is a round trip over the bus). With an adjacency cache
// (cache_off != 0: per node, the start of its neighbour list in the GPU-resident copy, or -1),
// a cached node's range is stored as -(start + 1) in that copy: the draw phase then reads the
// same neighbours, in the same order, from GPU memory instead of over the bus. The cache holds
// base lists only, which an overlay never changes, so it serves a node's base part as before.
// front_csc per node: (start, degree); with an overlay (ov_start != 0) four words: (start, counted
// base count, tail start, tail count | cut << 32), where a node with no counted base list has
// base count 0 and its id never indexes indptr or the cache; its cut's pairs lie just before its
// tail (2 words each).
__device__ i64 plan_frontier(const i64* __restrict__ indptr, const i64* frontier, i64 lo, i64 hi,
                             i64 k, int* front_off, i64* front_csc,
                             const i64* __restrict__ cache_off, const i64* __restrict__ ov_start,
                             const i64* __restrict__ ov_length, i64 n_base) {
    i64 planned = 0;
    for (i64 c = lo; c < hi; c += blockDim.x) {
        const i64 i = c + threadIdx.x;
        i64 cnt = 0;
        if (i < hi) {
            const i64 v = LOAD(frontier + i);
            i64 tail_start = 0, tail_deg = 0, cut = 0;
            bool has_base = true;
            if (ov_start) {
                const i64 raw_length = ov_length[v], first = ov_start[v];
                has_base = v < n_base && (raw_length & OV_REPLACED) == 0;
                if (has_base) cut = (raw_length >> OV_CUT_SHIFT) & OV_CUT_MASK;
                if (first >= 0) {
                    tail_start = first + 2 * cut;
                    tail_deg = raw_length & OV_LENGTH_MASK;
                }
            }
            i64 start = 0, base_deg = 0, cached = -1;
            if (has_base) {
                start = indptr[v];
                base_deg = indptr[v + 1] - start - cut;
                if (cache_off) cached = cache_off[v];
            }
            const i64 deg = base_deg + tail_deg;
            cnt = (k < 0 || deg <= k) ? deg : k;
            if (ov_start) {
                front_csc[4 * i] = cached >= 0 ? -(cached + 1) : start;
                front_csc[4 * i + 1] = base_deg;
                front_csc[4 * i + 2] = tail_start;
                front_csc[4 * i + 3] = tail_deg | (cut << 32);
            } else {
                front_csc[2 * i] = cached >= 0 ? -(cached + 1) : start;
                front_csc[2 * i + 1] = deg;
            }
        }
        i64 chunk_total;
        const i64 off = block_exclusive_scan(cnt, &chunk_total);
        if (i < hi) front_off[i] = (int)(planned + off);
        planned += chunk_total;
    }
    return planned;
}

__device__ void reset_state(const i64* n_id, i64 num_rows, int* state) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < num_rows; i += stride)
        state[LOAD(n_id + i)] = STATE_EMPTY;
}

// Seeds: validate, de-duplicate in first-occurrence order, and fill seed_index.
// `request` may be pinned host memory: it is read once, into `seeds` (device scratch), which
// saves the batch a separate host-to-device copy.
// Returns the number of unique seeds, or -1 (after cleaning up) when a seed is out of range.
__device__ i64 sample_seeds(i64 num_nodes, int* state, const i64* request, i64* seeds,
                            i64 num_seeds, i64* n_id, i64* seed_index, int* rank_buf,
                            i64* block_sums, u32* barrier) {
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    bool bad = false;
    for (i64 i = gtid; i < num_seeds; i += stride) {
        const i64 v = request[i];
        seeds[i] = v;
        if (v < 0 || v >= num_nodes) bad = true;
        else if (LOAD(state + v) > (int)i) atomicMin(state + v, (int)i);
    }
    if (bad) atomicOr(barrier + 2, 1u);
    grid_sync(barrier);
    if (LOAD(barrier + 2)) {
        for (i64 i = gtid; i < num_seeds; i += stride) {
            const i64 v = seeds[i];  // this thread's own write above
            if (v >= 0 && v < num_nodes) state[v] = STATE_EMPTY;
        }
        grid_sync(barrier);  // every block has read barrier[2] before it is cleared
        if (gtid == 0) barrier[2] = 0;
        return -1;
    }
    i64 lo, hi;
    block_range(num_seeds, &lo, &hi);
    const i64 ranked = rank_first_occurrences(seeds, lo, hi, state, rank_buf);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = ranked;
    grid_sync(barrier);
    i64 carry, num_unique;
    grid_carry(block_sums, ranked, &carry, &num_unique);
    assign_rows(seeds, lo, hi, carry, rank_buf, n_id, state);
    grid_sync(barrier);
    for (i64 i = gtid; i < num_seeds; i += stride)
        seed_index[i] = -(i64)LOAD(state + LOAD(seeds + i)) - 1;
    return num_unique;
}

// Kernel parameters, re-read from the block's shared copy at each use (as kernel parameters are
// from the constant bank) rather than held in registers for the whole kernel, which spilled.
#define P_INDPTR ((const i64*)P[0])
#define P_INDICES ((const i64*)P[1])
#define P_NUM_NODES (P[2])
#define P_STATE ((int*)P[3])
#define P_REQUEST ((const i64*)P[4])
#define P_SEEDS ((i64*)P[5])
#define P_NUM_SEEDS (P[6])
#define P_NUM_HOPS (P[7])
#define P_BASE (P[8])
#define P_N_ID ((i64*)P[9])
#define P_N_CAP (P[10])
#define P_E_CAP (P[11])
#define P_E_HOP_CAP (P[12])
#define P_COUNTS ((i64*)P[13])
#define P_COL_BUF ((int*)P[14])
#define P_FRONT_OFF ((int*)P[15])
#define P_FRONT_CSC ((i64*)P[16])
#define P_RANK_BUF ((int*)P[17])
#define P_BLOCK_SUMS ((i64*)P[18])
#define P_BARRIER ((u32*)P[19])
#define P_CACHE_OFF ((const i64*)P[20])
#define P_CACHE_INDICES (P[21])
#define P_CACHE_BITS (P[22])
#define P_OV_START ((const i64*)P[23])
#define P_OV_LENGTH ((const i64*)P[24])
#define P_OV_TAIL ((const i64*)P[25])
#define P_N_BASE (P[26])
#define P_FANOUT(hop) (P[NUM_PARAMS + (hop) - 1])
#define P_EDGES (P_N_ID + P_N_CAP)
#define P_SEED_INDEX (P_EDGES + 2 * P_E_CAP)

// The value at base place q of a list with a cut: its override pair's when one of the `cut`
// (position, value) pairs at `pairs` (sorted by position) names q, else `value`.
__device__ __forceinline__ i64 override_or(const i64* pairs, i64 cut, i64 q, i64 value) {
    i64 lo = 0, hi = cut;
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if (pairs[2 * mid] < q) lo = mid + 1; else hi = mid;
    }
    return lo < cut && pairs[2 * lo] == q ? pairs[2 * lo + 1] : value;
}

// One warp writes the sampled neighbours of frontier node i (its list as plan_frontier described
// it in front_csc) at hop-local position carry + front_off[i] on: the whole list in list order
// when k < 0 or deg <= k, else the entries at Floyd's offsets, in draw order. The list's start
// is loaded first (its latency hides behind the draws); the reader and the overlay's split and
// tail are formed after the draws, so that they hold no registers during them.
__device__ __forceinline__ void expand_node(const volatile i64* P, i64 i, i64 k, i64 hop,
                                            i64 front_lo, i64 carry, i64 edges_before, int lane) {
    const bool overlay = P_OV_START != 0;
    const i64* node_csc = P_FRONT_CSC + (overlay ? 4 * i : 2 * i);
    const i64 start = LOAD(node_csc);  // < 0: in the adjacency cache
    const i64 deg = overlay ? LOAD(node_csc + 1) + (LOAD(node_csc + 3) & OV_LENGTH_MASK)
                            : LOAD(node_csc + 1);
    const i64 p0 = carry + LOAD(P_FRONT_OFF + i);
    i64* rows = P_EDGES + edges_before;
    const bool whole = k < 0 || deg <= k;
    if (!whole) draw_offsets(LOAD(P_N_ID + front_lo + i), deg, k, hop, (u32)P_BASE, p0, rows, lane);

    const bool cached = start < 0;
    const i64 split = overlay ? LOAD(node_csc + 1) : deg;  // the base part's length
    // Entry q >= split of the list is tail[q]; never read without an overlay (split == deg).
    const i64* tail = overlay ? P_OV_TAIL + (LOAD(node_csc + 2) - split) : P_OV_TAIL;
    const u32 cache_bits = (u32)P_CACHE_BITS;
    i64 first = cached ? -start - 1 : start;
    ListReader list{cached ? (const void*)P_CACHE_INDICES : (const void*)P_INDICES,
                    cached ? cache_bits : 64u, 0u};
    // a cut's pairs: the 2 * cut words before the tail (base places >= split are spent)
    const i64 cut = overlay ? LOAD(node_csc + 3) >> 32 : 0;
    const i64* pairs = tail + split - 2 * cut;
    if (cached && cache_bits == 0) {  // Elias-Fano: the offset is the block, l above it
        list.base = (const u32*)P_CACHE_INDICES + (first & EF_OFFSET_MASK);
        list.ef = (u32)(split + cut) | ((u32)(first >> EF_L_SHIFT) << EF_DEG_BITS);
        first = 0;
    }
    const int owner = (int)(front_lo + i);
    int* cols = P_COL_BUF + edges_before;
    const i64 count = whole ? deg : k;
    for (i64 j = lane; j < count; j += 32) {
        const i64 q = whole ? j : rows[p0 + j];
        i64 u = q < split ? list[first + q] : tail[q];
        if (cut && q < split) u = override_or(pairs, cut, q, u);
        emit_edge(p0 + j, u, owner, rows, cols, P_STATE);
    }
}

__device__ __forceinline__ void sample_batch(const volatile i64* P) {
    const bool leader = blockIdx.x == 0 && threadIdx.x == 0;
    const i64 num_unique = sample_seeds(P_NUM_NODES, P_STATE, P_REQUEST, P_SEEDS, P_NUM_SEEDS,
                                        P_N_ID, P_SEED_INDEX, P_RANK_BUF, P_BLOCK_SUMS, P_BARRIER);
    if (num_unique < 0) {
        if (leader) P_COUNTS[0] = STATUS_BAD_SEED;
        return;
    }
    if (leader) P_COUNTS[COUNTS_HEADER] = num_unique;

    i64 num_rows = num_unique, front_lo = 0, edges_before = 0, lo, hi, carry;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (i64 hop = 1; hop <= P_NUM_HOPS; ++hop) {
        const i64 k = P_FANOUT(hop);
        const i64* frontier = P_N_ID + front_lo;
        // 1. size each frontier node's share of the hop
        block_range(num_rows - front_lo, &lo, &hi);
        const i64 planned = plan_frontier(P_INDPTR, frontier, lo, hi, k, P_FRONT_OFF, P_FRONT_CSC,
                                          P_CACHE_OFF, P_OV_START, P_OV_LENGTH, P_N_BASE);
        if (threadIdx.x == 0) P_BLOCK_SUMS[blockIdx.x] = planned;
        grid_sync(P_BARRIER);
        i64 hop_edges;
        grid_carry(P_BLOCK_SUMS, planned, &carry, &hop_edges);
        const i64 room = P_NUM_NODES - num_rows;
        const i64 new_bound = hop_edges < room ? hop_edges : room;
        if (hop_edges > P_E_HOP_CAP || edges_before + hop_edges > P_E_CAP ||
            num_rows + new_bound > P_N_CAP) {
            // Buffers too small (a hop whose bound exceeded the host's guess, e.g. fanout -1):
            // report what this hop needs; the host grows them and runs the batch again.
            reset_state(P_N_ID, num_rows, P_STATE);
            if (leader) {
                P_COUNTS[0] = STATUS_OVERFLOW;
                P_COUNTS[1] = num_rows + new_bound;
                P_COUNTS[2] = hop_edges;
                P_COUNTS[3] = edges_before + hop_edges;
            }
            return;
        }
        // 2. draw: one warp per frontier node; neighbours propose their first occurrence
        for (i64 i = lo + warp; i < hi; i += num_warps)
            expand_node(P, i, k, hop, front_lo, carry, edges_before, lane);
        grid_sync(P_BARRIER);
        // 3. rank the first occurrences, 4. give them rows, 5. relabel the hop's edges
        block_range(hop_edges, &lo, &hi);
        const i64 ranked = rank_first_occurrences(P_EDGES + edges_before, lo, hi, P_STATE, P_RANK_BUF);
        if (threadIdx.x == 0) P_BLOCK_SUMS[blockIdx.x] = ranked;
        grid_sync(P_BARRIER);
        i64 num_new;
        grid_carry(P_BLOCK_SUMS, ranked, &carry, &num_new);
        assign_rows(P_EDGES + edges_before, lo, hi, num_rows + carry, P_RANK_BUF, P_N_ID, P_STATE);
        grid_sync(P_BARRIER);
        relabel(P_EDGES + edges_before, lo, hi, P_STATE);
        if (leader) {
            P_COUNTS[COUNTS_HEADER + hop] = num_new;
            P_COUNTS[COUNTS_HEADER + P_NUM_HOPS + hop] = hop_edges;
        }
        front_lo = num_rows;
        num_rows += num_new;
        edges_before += hop_edges;
        // No barrier here: the next hop's first phase touches neither rows nor state.
    }
    grid_sync(P_BARRIER);  // every relabel has read state before the reset
    reset_state(P_N_ID, num_rows, P_STATE);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64* cols_out = P_EDGES + edges_before;
    const int* col_buf = P_COL_BUF;
    for (i64 p = gtid; p < edges_before; p += stride) cols_out[p] = LOAD(col_buf + p);
    if (leader) P_COUNTS[0] = STATUS_OK;
}

extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS, 1)
sample_subgraph(const i64* params) {
    i64* shared_params = block_params();
    if (threadIdx.x < NUM_PARAMS + MAX_HOPS) shared_params[threadIdx.x] = params[threadIdx.x];
    __syncthreads();
    sample_batch(shared_params);
}
