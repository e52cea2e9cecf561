// Feature-store gather (docs/architecture.md, "Feature store"): out[i] = row of node n_id[i],
// wherever that row lives.
//
// Compiled at run time by CuPy (NVRTC) and launched from quiver_serve/features/gather.py on
// torch's current stream. One warp copies one row; hits come from GPU memory (this GPU's shard
// or a peer's, read directly over NVLink/PCIe with peer access), misses from pinned host memory
// mapped into the GPU's address space (zero-copy: the warp's loads cross the bus, no staging).
//
// Everything the kernel needs to find a row is in `table` (int64, device memory):
//   [0] location map (int64 per node: tier << 56 | row), or 0: every row in tier [2] at row = id
//   [1] number of GPU tiers (a row in tier < [1] is a hit)
//   [2] the tier used when there is no map
//   [3] number of tiers
//   [4 ...] base address of each tier's rows
// Re-placement writes a new table (one small copy on the serving stream), so kernels queued
// earlier, and CUDA graphs captured earlier, read the old or the new layout, never a mix.
// The grid depends on the number of rows only: a launch can be captured in a CUDA graph.
// `counts` (2 x u64, device): hits and misses, accumulated (one atomic per block and kind).

typedef long long i64;
typedef unsigned long long u64;

#define TIER_SHIFT 56
#define ROW_MASK ((1LL << TIER_SHIFT) - 1)
#define GATHER_THREADS 256

template <typename W>
__device__ __forceinline__ void gather_rows(const i64* __restrict__ n_id, i64 n,
                                            const i64* __restrict__ table, i64 words,
                                            W* __restrict__ out, u64* counts) {
    __shared__ u64 block_hits, block_misses;
    if (threadIdx.x == 0) {
        block_hits = 0;
        block_misses = 0;
    }
    __syncthreads();
    const i64* loc = (const i64*)table[0];
    const i64 gpu_tiers = table[1], plain_tier = table[2];
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    u64 hits = 0, misses = 0;
    for (i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < n; i += warps) {
        const i64 v = n_id[i];
        const i64 code = loc ? loc[v] : ((plain_tier << TIER_SHIFT) | v);
        const i64 tier = code >> TIER_SHIFT;
        const W* src = (const W*)table[4 + tier] + (code & ROW_MASK) * words;
        W* dst = out + i * words;
        for (i64 w = lane; w < words; w += 32) dst[w] = src[w];
        if (lane == 0) {
            if (tier < gpu_tiers) ++hits;
            else ++misses;
        }
    }
    if (lane == 0) {
        if (hits) atomicAdd(&block_hits, hits);
        if (misses) atomicAdd(&block_misses, misses);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (block_hits) atomicAdd(counts, block_hits);
        if (block_misses) atomicAdd(counts + 1, block_misses);
    }
}

struct __align__(16) w16 { unsigned int a, b, c, d; };
struct __align__(8) w8 { unsigned int a, b; };

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_w16(const i64* n_id, i64 n, const i64* table, i64 words, w16* out, u64* counts) {
    gather_rows<w16>(n_id, n, table, words, out, counts);
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_w8(const i64* n_id, i64 n, const i64* table, i64 words, w8* out, u64* counts) {
    gather_rows<w8>(n_id, n, table, words, out, counts);
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_w4(const i64* n_id, i64 n, const i64* table, i64 words, unsigned int* out, u64* counts) {
    gather_rows<unsigned int>(n_id, n, table, words, out, counts);
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_w2(const i64* n_id, i64 n, const i64* table, i64 words, unsigned short* out,
          u64* counts) {
    gather_rows<unsigned short>(n_id, n, table, words, out, counts);
}
