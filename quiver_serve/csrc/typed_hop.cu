// One hop of one relation of a typed graph (docs/architecture.md, "Typed graphs"; decision 0050):
// the twin of sampling/typed.py's TypedReferenceSampler.hop_edges, launched by
// sampling/typed_gpu.py. Two kernels per (relation, hop):
//
//   typed_hop_count: per frontier node, how many neighbours it reads (its degree, or k when its
//                    degree exceeds k >= 0);
//   typed_hop_draw:  one warp per frontier node writes its neighbours' ids and edge ids at its
//                    output offset (the exclusive scan of the counts, done by torch between the
//                    two): the whole list in list order, or Floyd's k-of-deg draws in draw order
//                    with the relation's salted base (the same numbers as base.node_hash/draw32).
//
// The CSC is read through raw addresses, so it may be in GPU memory or in host memory pinned
// and mapped (UVA). Every argument is a 64-bit integer (addresses included): one argument type
// for CuPy to pass.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

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

extern "C" __global__ void typed_hop_count(i64 indptr_addr, i64 frontier_addr, i64 n, i64 k,
                                           i64 count_addr) {
    const i64* indptr = (const i64*)indptr_addr;
    const i64* frontier = (const i64*)frontier_addr;
    i64* count = (i64*)count_addr;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 v = frontier[i];
        const i64 deg = indptr[v + 1] - indptr[v];
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

extern "C" __global__ void typed_hop_draw(i64 indptr_addr, i64 indices_addr, i64 edge_id_addr,
                                          i64 frontier_addr, i64 n, i64 k, i64 base, i64 hop,
                                          i64 offset_addr, i64 nbr_addr, i64 eid_addr) {
    const i64* indptr = (const i64*)indptr_addr;
    const i64* indices = (const i64*)indices_addr;
    const i64* edge_id = (const i64*)edge_id_addr;  // 0: entries are in edge-id order
    const i64* frontier = (const i64*)frontier_addr;
    const i64* offset = (const i64*)offset_addr;
    i64* nbr = (i64*)nbr_addr;
    i64* eid = (i64*)eid_addr;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 i = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); i < n; i += warps) {
        const i64 v = frontier[i];
        const i64 start = indptr[v], deg = indptr[v + 1] - start, at = offset[i];
        const bool whole = k < 0 || deg <= k;
        const i64 reads = whole ? deg : k;
        if (!whole) draw_offsets(v, deg, k, hop, (u32)base, eid + at, lane);
        for (i64 d = lane; d < reads; d += 32) {
            const i64 p = start + (whole ? d : eid[at + d]);
            nbr[at + d] = indices[p];
            eid[at + d] = edge_id ? edge_id[p] : p;
        }
        __syncwarp();
    }
}
