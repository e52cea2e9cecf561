// Neighbour aggregation of one sampled layer (models/fast.py): for each target v of the layer,
//   out[v, :] = sum over in-edges e of v of dense[col[e], :]      (sum)
//   out[v, :] = that sum / in-degree(v), 0 without in-edges         (mean, as PyG's scatter mean)
// The layer's edges are a CSR prefix (rowptr over targets, col = source row). One launch
// replaces the per-edge weights, the sparse tensor and cuSPARSE's set-up of the torch path, whose
// host cost is what a sampled batch pays (its GPU time is a small part).
//
// Compiled at run time by CuPy (NVRTC) and launched on torch's current stream. One warp per
// target row, lanes over the feature columns (coalesced reads of each source row); each output
// element is a sequential fp32 sum over its row's edges, in edge order (deterministic). Meant for
// sampled layers, whose in-degree is bounded by the fanout; unbounded rows (exact mode) keep the
// torch path, which balances long rows across threads.

typedef long long i64;

template <typename I>
__device__ __forceinline__ void aggregate_rows(const I* __restrict__ rowptr,
                                               const I* __restrict__ col,
                                               const float* __restrict__ dense, i64 dim,
                                               float* __restrict__ out, i64 num_dst, int mean) {
    const i64 lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 v = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; v < num_dst; v += warps) {
        const i64 start = (i64)rowptr[v], end = (i64)rowptr[v + 1];
        for (i64 f = lane; f < dim; f += 32) {
            float acc = 0.0f;
            for (i64 e = start; e < end; ++e) {
                acc += dense[(i64)col[e] * dim + f];
            }
            if (mean && end > start) {
                acc = acc / (float)(end - start);
            }
            out[v * dim + f] = acc;
        }
    }
}

extern "C" __global__ void csr_aggregate_i32(const int* rowptr, const int* col, const float* dense,
                                             i64 dim, float* out, i64 num_dst, int mean) {
    aggregate_rows<int>(rowptr, col, dense, dim, out, num_dst, mean);
}

extern "C" __global__ void csr_aggregate_i64(const i64* rowptr, const i64* col,
                                             const float* dense, i64 dim, float* out,
                                             i64 num_dst, int mean) {
    aggregate_rows<i64>(rowptr, col, dense, dim, out, num_dst, mean);
}
