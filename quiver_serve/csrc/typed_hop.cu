// One typed batch, hop by hop, on the GPU (docs/architecture.md, "Typed graphs"; decisions 0050
// and 0062): the twin of sampling/typed.py's TypedReferenceSampler.sample, launched by
// sampling/typed_gpu.py. Every kernel covers all relations of a hop at once, so a hop costs a
// fixed handful of launches and one host synchronisation, whatever the number of relations and
// node types:
//
//   typed_count:   per frontier entry of every relation, how many neighbours it reads;
//   (torch)        end = inclusive scan of the counts: the hop's output positions;
//   typed_draw:    one warp per frontier entry writes its neighbours (as state keys), edge ids,
//                  destination local ids and source types at its positions, and proposes each
//                  position as its neighbour's first occurrence (atomicMin on the state);
//   typed_mark:    flag = 1 where a position is its neighbour's first occurrence;
//   (torch)        csum = inclusive scan of the flags;
//   typed_assign:  gives each first occurrence its local id (rank within its source type) and
//                  writes the new nodes' ids grouped by type, and the hop's sizes (read by the
//                  host in the hop's one synchronisation);
//   typed_relabel: every position's local source id;
//   typed_reset:   the batch's state entries back to empty (after the last hop).
//
// Layout of a hop's output: relations ordered by source type, then by their position in the
// graph's edge types, each in frontier order; so a type's positions are contiguous and, within
// them, in the reference's relation-by-relation order, and "first occurrence" is the reference's.
//
// State: an int32 per node of every type (types at their offsets), EMPTY between batches;
// during a hop >= 0 is the smallest position where the node appeared, < 0 a node with a row:
// -(local_id + 1). Positions of one hop only meet positions of the same hop.
//
// The CSC is read through raw addresses (GPU memory, or host memory pinned and mapped: UVA).
// Every argument is a 64-bit integer (addresses included): one argument type for CuPy to pass.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu
#define STATE_EMPTY 0x7fffffff
#define LOAD_STATE(p) (*(volatile const int*)(p))

// A relation's entry in a hop's descriptor table (int64 fields, DESC_FIELDS per relation).
#define D_INDPTR 0
#define D_INDICES 1
#define D_EDGE_ID 2    // 0: edge ids are CSC positions
#define D_FRONTIER 3   // int64 global ids of the frontier (nodes of the relation's destination type)
#define D_FIRST 4      // index of its first frontier entry among the hop's entries
#define D_N 5          // frontier entries
#define D_K 6          // fanout (-1: all)
#define D_BASE 7       // the relation's salted random base
#define D_SRC_OFF 8    // state offset of the source type
#define D_SRC_TYPE 9   // source type's index
#define D_DST_LO 10    // local id of the frontier's first node in its type
#define DESC_FIELDS 11

// A node type's entry in the hop's type table (int64 fields, TYPE_FIELDS per type).
#define T_OFF 0      // state offset
#define T_BEFORE 1   // nodes of the type with a local id before this hop
#define T_FIRST 2    // index of the first frontier entry of its first relation (-1: none)
#define T_LAST 3     // index of the last frontier entry of its last relation
#define TYPE_FIELDS 4

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

// The descriptor of entry i: the last relation whose first entry is <= i.
__device__ __forceinline__ const i64* find_desc(const i64* desc, i64 num_desc, i64 i) {
    i64 lo = 0, hi = num_desc - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if (desc[mid * DESC_FIELDS + D_FIRST] <= i) lo = mid; else hi = mid - 1;
    }
    return desc + lo * DESC_FIELDS;
}

extern "C" __global__ void typed_count(i64 desc_addr, i64 num_desc, i64 n, i64 count_addr) {
    const i64* desc = (const i64*)desc_addr;
    i64* count = (i64*)count_addr;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const i64* d = find_desc(desc, num_desc, i);
        const i64* indptr = (const i64*)d[D_INDPTR];
        const i64 v = ((const i64*)d[D_FRONTIER])[i - d[D_FIRST]];
        const i64 deg = indptr[v + 1] - indptr[v], k = d[D_K];
        count[i] = (k < 0 || deg <= k) ? deg : k;
    }
}

// Floyd's k-of-deg choices (deg > k) of node v as offsets into its list, in draw order, at
// out[0 .. k): draw i's candidate is computed by lane i % 32; the test against the earlier
// choices is a warp vote per draw. Lane i % 32 writes draw i, and only it reads it back.
__device__ void draw_offsets(i64 v, i64 deg, i64 k, i64 hop, u32 base, i64* out, int lane) {
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
            for (int q = lane; q < round; q += 32) taken |= out[q] == c;
            const u32 any_taken = __ballot_sync(FULL_MASK, taken);
            if (lane == s) chosen = any_taken ? t : c;
        }
        if (i < num_draws) out[i] = chosen;
        __syncwarp();
    }
}

// One warp per frontier entry i: its neighbours at positions end[i] - count[i] ... end[i] - 1.
extern "C" __global__ void typed_draw(i64 desc_addr, i64 num_desc, i64 n, i64 hop,
                                      i64 count_addr, i64 end_addr, i64 key_addr, i64 eid_addr,
                                      i64 col_addr, i64 stype_addr, i64 state_addr) {
    const i64* desc = (const i64*)desc_addr;
    const i64* count = (const i64*)count_addr;
    const i64* end = (const i64*)end_addr;
    i64* key = (i64*)key_addr;
    i64* eid = (i64*)eid_addr;
    i64* col = (i64*)col_addr;
    int* stype = (int*)stype_addr;
    int* state = (int*)state_addr;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 i = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); i < n; i += warps) {
        const i64* d = find_desc(desc, num_desc, i);
        const i64* indptr = (const i64*)d[D_INDPTR];
        const i64* indices = (const i64*)d[D_INDICES];
        const i64* edge_id = (const i64*)d[D_EDGE_ID];
        const i64 j = i - d[D_FIRST];
        const i64 v = ((const i64*)d[D_FRONTIER])[j];
        const i64 start = indptr[v], deg = indptr[v + 1] - start, k = d[D_K];
        const i64 reads = count[i], at = end[i] - reads;
        const bool whole = k < 0 || deg <= k;
        if (!whole) draw_offsets(v, deg, k, hop, (u32)d[D_BASE], eid + at, lane);
        const i64 src_off = d[D_SRC_OFF], c = d[D_DST_LO] + j;
        const int s = (int)d[D_SRC_TYPE];
        for (i64 q = lane; q < reads; q += 32) {
            const i64 p = start + (whole ? q : eid[at + q]);
            const i64 u = src_off + indices[p], pos = at + q;
            key[pos] = u;
            eid[pos] = edge_id ? edge_id[p] : p;
            col[pos] = c;
            stype[pos] = s;
            // a known node (negative) or an earlier position already wins: no atomic then
            if (LOAD_STATE(state + u) > (int)pos) atomicMin(state + u, (int)pos);
        }
        __syncwarp();
    }
}

// Seeds (hop 0): position i proposes itself as key[i]'s first occurrence.
extern "C" __global__ void typed_propose(i64 n, i64 key_addr, i64 state_addr) {
    const i64* key = (const i64*)key_addr;
    int* state = (int*)state_addr;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 u = key[i];
        if (LOAD_STATE(state + u) > (int)i) atomicMin(state + u, (int)i);
    }
}

// flag[p] = 1 where p < *total_addr is its key's first occurrence, 0 up to cap; and the end
// position of each relation (rel_end[r] = end[last entry of r]) for the host's summary.
extern "C" __global__ void typed_mark(i64 total_addr, i64 cap, i64 key_addr, i64 state_addr,
                                      i64 flag_addr, i64 desc_addr, i64 num_desc, i64 end_addr,
                                      i64 rel_end_addr) {
    const i64 total = *(const i64*)total_addr;
    const i64* key = (const i64*)key_addr;
    const int* state = (const int*)state_addr;
    i64* flag = (i64*)flag_addr;
    const i64 span = cap > num_desc ? cap : num_desc;
    for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < span;
         p += (i64)gridDim.x * blockDim.x) {
        if (p < cap) flag[p] = p < total && state[key[p]] == (int)p;
        if (p < num_desc) {
            const i64* d = (const i64*)desc_addr + p * DESC_FIELDS;
            ((i64*)rel_end_addr)[p] = ((const i64*)end_addr)[d[D_FIRST] + d[D_N] - 1];
        }
    }
}

// First occurrences get local ids: the global rank r = csum[p] - 1 orders them by type, then
// position; new ids of type t are written at new_ids[r] (a type's run starts at the number of
// first occurrences in earlier types) and its local id is before_t + (r - that start). The
// thread at a type's last position writes the type's number of new nodes.
extern "C" __global__ void typed_assign(i64 total_addr, i64 key_addr, i64 stype_addr,
                                        i64 csum_addr, i64 types_addr, i64 end_addr,
                                        i64 new_ids_addr, i64 new_count_addr, i64 state_addr) {
    const i64 total = *(const i64*)total_addr;
    const i64* key = (const i64*)key_addr;
    const int* stype = (const int*)stype_addr;
    const i64* csum = (const i64*)csum_addr;
    const i64* types = (const i64*)types_addr;
    const i64* end = (const i64*)end_addr;
    i64* new_ids = (i64*)new_ids_addr;
    i64* new_count = (i64*)new_count_addr;
    int* state = (int*)state_addr;
    for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < total;
         p += (i64)gridDim.x * blockDim.x) {
        const int t = stype[p];
        const i64* ty = types + (i64)t * TYPE_FIELDS;
        const i64 first = ty[T_FIRST];
        const i64 seg_start = first > 0 ? end[first - 1] : 0;
        const i64 run_start = seg_start > 0 ? csum[seg_start - 1] : 0;
        const i64 here = csum[p], before = p > 0 ? csum[p - 1] : 0;
        if (here != before) {
            const i64 r = here - 1, u = key[p];
            new_ids[r] = u - ty[T_OFF];
            state[u] = (int)(-(ty[T_BEFORE] + (r - run_start)) - 1);
        }
        if (p == end[ty[T_LAST]] - 1) new_count[t] = here - run_start;
    }
}

// rows[p]: the local id of position p's node (every key has one after typed_assign).
extern "C" __global__ void typed_relabel(i64 total_addr, i64 key_addr, i64 state_addr,
                                         i64 rows_addr) {
    const i64 total = *(const i64*)total_addr;
    const i64* key = (const i64*)key_addr;
    const int* state = (const int*)state_addr;
    i64* rows = (i64*)rows_addr;
    for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < total;
         p += (i64)gridDim.x * blockDim.x)
        rows[p] = -(i64)state[key[p]] - 1;
}

// The state entries of a hop's keys back to empty.
extern "C" __global__ void typed_reset(i64 total_addr, i64 key_addr, i64 state_addr) {
    const i64 total = *(const i64*)total_addr;
    const i64* key = (const i64*)key_addr;
    int* state = (int*)state_addr;
    for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < total;
         p += (i64)gridDim.x * blockDim.x)
        state[key[p]] = STATE_EMPTY;
}

// The batch's output from its hop buffers in one launch: segment s copies len_s int64 values
// from src_s to dst_s; table = [first_0, src_0, dst_0, first_1, ...] with first_s the index of
// the segment's first value among all n values (segments in order).
extern "C" __global__ void typed_gather_segments(i64 table_addr, i64 num_segments, i64 n) {
    const i64* table = (const i64*)table_addr;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 lo = 0, hi = num_segments - 1;
        while (lo < hi) {
            const i64 mid = (lo + hi + 1) >> 1;
            if (table[mid * 3] <= i) lo = mid; else hi = mid - 1;
        }
        const i64* seg = table + lo * 3;
        ((i64*)seg[2])[i - seg[0]] = ((const i64*)seg[1])[i - seg[0]];
    }
}

// Seeds de-duplicated by the host (hop 0 without a host synchronisation): unique seed i, of
// state key key[i], gets local id i.
extern "C" __global__ void typed_claim(i64 total_addr, i64 key_addr, i64 state_addr) {
    const i64 total = *(const i64*)total_addr;
    const i64* key = (const i64*)key_addr;
    int* state = (int*)state_addr;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x)
        state[key[i]] = (int)(-i - 1);
}
