// CPU neighbour sampler: the C++ twin of quiver_serve/sampling/reference.py.
//
// Output is bit-for-bit the reference's for the same (graph, seeds, fanouts, seed): the random
// numbers are the counter-based hash of quiver_serve/sampling/base.py (a pure function of batch
// seed, hop, node and draw index), so the result does not depend on the thread count.
//
// Per hop: pass 1 counts each frontier node's sample, a prefix sum places it, pass 2 fills the
// neighbours (both parallel over the frontier with at::parallel_for, i.e. torch's intra-op
// threads); then one sequential pass maps global ids to local ids through a flat hash table,
// which gives exact first-occurrence order without any O(num_nodes) allocation per call.
//
// A node's list is two segments (NodeList): its base CSC list, then its overlay tail when an
// overlay of graph updates is passed (quiver_serve/graph/overlay_view.py); without one every
// tail is empty and the reads are the CSC's alone.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// ---- counter-based random numbers (must match quiver_serve/sampling/base.py) ----------------
// uint32 arithmetic wraps mod 2**32, which is exactly the Python spec's "& MASK32".
constexpr uint32_t kMixMul = 0x45D9F3Bu;
constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr uint32_t kHopMul = 0x632BE5ABu;
constexpr uint32_t kDrawMul = 0x85EBCA6Bu;

inline uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * kMixMul;
  x = ((x >> 16) ^ x) * kMixMul;
  return (x >> 16) ^ x;
}

inline uint32_t seed_base(uint64_t seed) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) ^ kGolden));
}

inline uint32_t node_hash(uint32_t base, uint32_t hop_term, int64_t node) {
  return mix32(base ^ mix32(static_cast<uint32_t>(node) + hop_term));
}

inline uint32_t draw32(uint32_t node_h, uint32_t draw) { return mix32(node_h ^ (draw * kDrawMul)); }

// Draws above this size test "already taken" with a small hash set instead of a scan, so a large
// fanout stays O(k) per node rather than O(k^2).
constexpr int64_t kLinearScanMaxK = 64;

// The spec computes r * (t + 1) in int64, exact only while degrees stay below 2**31.
constexpr int64_t kMaxSampledDegree = int64_t{1} << 31;

// Floyd's k-of-d selection (d > k) in draw order; writes the k chosen local offsets to `out`.
// `scratch` must hold a power-of-two table of at least 2k slots when k > kLinearScanMaxK.
void floyd_select(int64_t degree, int64_t k, uint32_t node_h, int64_t* out,
                  std::vector<int64_t>& scratch) {
  const bool use_set = k > kLinearScanMaxK;
  uint64_t mask = 0;
  if (use_set) {
    uint64_t cap = 1;
    while (cap < static_cast<uint64_t>(2 * k)) cap <<= 1;
    scratch.assign(cap, -1);
    mask = cap - 1;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t t = degree - k + i;
    const uint64_t r = draw32(node_h, static_cast<uint32_t>(i));
    int64_t j = static_cast<int64_t>((r * static_cast<uint64_t>(t + 1)) >> 32);
    if (!use_set) {
      for (int64_t p = 0; p < i; ++p) {
        if (out[p] == j) {
          j = t;  // t is larger than every earlier draw, so it is never taken yet
          break;
        }
      }
    } else {
      uint64_t s = (static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ull) >> 32 & mask;
      while (scratch[s] != -1 && scratch[s] != j) s = (s + 1) & mask;
      if (scratch[s] == j) {
        j = t;
        s = (static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ull) >> 32 & mask;
        while (scratch[s] != -1) s = (s + 1) & mask;
      }
      scratch[s] = j;
    }
    out[i] = j;
  }
}

// Global id -> local id, open addressing with linear probing; grows by rebuilding from n_id
// (local id == position in n_id), so it never needs its own copy of the values.
class LocalIdMap {
 public:
  // Make room for `max_entries` keys at load factor <= 1/2.
  void reserve(int64_t max_entries, const std::vector<int64_t>& n_id) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(2 * max_entries)) cap <<= 1;
    if (cap <= slots_.size()) return;
    slots_.assign(cap, Slot{-1, -1});
    mask_ = cap - 1;
    shift_ = 64 - __builtin_ctzll(cap);
    for (int64_t i = 0; i < static_cast<int64_t>(n_id.size()); ++i) find_or_insert(n_id[i], i);
  }

  inline void prefetch(int64_t key) const {
    __builtin_prefetch(slots_.data() + ((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_));
  }

  // The local id of `key`, inserting it as `next_local` when absent.
  inline int64_t find_or_insert(int64_t key, int64_t next_local) {
    uint64_t s = (static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_;
    for (;;) {
      Slot& slot = slots_[s];
      if (slot.key == key) return slot.local;
      if (slot.key == -1) {
        slot.key = key;
        slot.local = next_local;
        return next_local;
      }
      s = (s + 1) & mask_;
    }
  }

 private:
  struct Slot {
    int64_t key;
    int64_t local;
  };
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  int shift_ = 64;
};

void check_csc(const at::Tensor& indptr, const at::Tensor& indices) {
  // Shared-memory graphs are read in place: refuse rather than silently copy.
  TORCH_CHECK(indptr.device().is_cpu() && indices.device().is_cpu(),
              "cpu_sampler: indptr and indices must be CPU tensors");
  TORCH_CHECK_TYPE(indptr.scalar_type() == at::kLong, "cpu_sampler: indptr must be int64, got ",
                   indptr.scalar_type());
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong, "cpu_sampler: indices must be int64, got ",
                   indices.scalar_type());
  TORCH_CHECK(indptr.dim() == 1 && indptr.numel() >= 1,
              "cpu_sampler: indptr must be 1-D with num_nodes + 1 entries");
  TORCH_CHECK(indices.dim() == 1, "cpu_sampler: indices must be 1-D");
  TORCH_CHECK(indptr.is_contiguous() && indices.is_contiguous(),
              "cpu_sampler: indptr and indices must be contiguous (they are read in place, "
              "never copied)");
  const int64_t last = indptr.data_ptr<int64_t>()[indptr.numel() - 1];
  TORCH_CHECK(last == indices.numel(), "cpu_sampler: indptr[-1]=", last, " but there are ",
              indices.numel(), " indices");
}

at::Tensor vector_to_tensor(std::vector<int64_t>&& values) {
  // Hand the buffer to the tensor instead of copying it.
  auto* owned = new std::vector<int64_t>(std::move(values));
  return torch::from_blob(
      owned->data(), {static_cast<int64_t>(owned->size())},
      [owned](void*) { delete owned; }, torch::TensorOptions().dtype(torch::kInt64));
}

// Nodes per chunk of a parallel loop: enough work that claiming a chunk is noise.
int64_t grain_nodes(int64_t fanout) {
  const int64_t per_node = fanout > 0 ? fanout : 32;
  return std::max<int64_t>(16, 4096 / per_node);
}

// at::parallel_for gives each thread one equal slice, but frontier nodes differ in cost (hubs under
// fanout -1) and on a shared box one thread may be descheduled; so torch's threads claim small
// chunks from a counter and a slow thread holds up at most one chunk.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& fn) {
  const int64_t num_chunks = (n + grain - 1) / grain;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (workers <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t lo = next.fetch_add(grain); lo < n; lo = next.fetch_add(grain)) {
      fn(lo, std::min(lo + grain, n));
    }
  });
}

// A buffer that is not zero-filled: every element is written before it is read.
using Buffer = std::unique_ptr<int64_t[]>;
inline Buffer make_buffer(int64_t n) { return Buffer(new int64_t[std::max<int64_t>(n, 1)]); }

struct HopEdges {
  int64_t num_edges = 0;
  Buffer nbr;    // global id of each sampled neighbour in frontier order; local id after dedup
  Buffer owner;  // local id of the frontier node that drew it
};

// The graph one call samples: the base CSC and, when set, the overlay of updates since it
// (quiver_serve/graph/overlay_view.py). Without an overlay, tail_start is null and
// num_nodes == n_base.
struct LivingGraph {
  const int64_t* indptr;
  const int64_t* indices;
  int64_t num_indices;
  int64_t n_base;     // nodes with a base list
  int64_t num_nodes;  // valid ids: [0, num_nodes)
  const int64_t* tail_start = nullptr;
  const int64_t* tail_length = nullptr;  // tail length | cut << kCutShift | kReplaced
  const int64_t* tail = nullptr;
  int64_t tail_capacity = 0;
};

// overlay_view.REPLACED, LENGTH_MASK, CUT_SHIFT and CUT_MASK
constexpr int64_t kReplaced = int64_t{1} << 62;
constexpr int64_t kLengthMask = (int64_t{1} << 32) - 1;
constexpr int kCutShift = 32;
constexpr int64_t kCutMask = (int64_t{1} << 30) - 1;

// One node's current neighbour list: `base_count` entries at `base` (place r overridden by the
// pair naming it among `pairs`' `cut` (position, value) pairs, sorted), then the rest at `tail`.
struct NodeList {
  const int64_t* base;
  int64_t base_count;
  const int64_t* tail;
  int64_t degree;
  const int64_t* pairs = nullptr;
  int64_t cut = 0;
  inline int64_t operator[](int64_t q) const {
    if (q >= base_count) return tail[q - base_count];
    return cut ? override_or(q, base[q]) : base[q];
  }
  inline const int64_t* address(int64_t q) const {
    return q < base_count ? base + q : tail + (q - base_count);
  }
  // The value at base place q: its pair's when one names q, else `value`.
  inline int64_t override_or(int64_t q, int64_t value) const {
    int64_t lo = 0, hi = cut;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (pairs[2 * mid] < q) lo = mid + 1; else hi = mid;
    }
    return lo < cut && pairs[2 * lo] == q ? pairs[2 * lo + 1] : value;
  }
};

enum class ListError { kNone, kIndptr, kOverlay };

// The list of node v (0 <= v < num_nodes), or the reason it cannot be read.
inline ListError node_list(const LivingGraph& g, int64_t v, NodeList* list) {
  const int64_t raw_length = g.tail_start ? g.tail_length[v] : 0;
  int64_t cut = 0;  // only a counted base list has one
  list->base = g.indices;
  list->base_count = 0;
  list->pairs = nullptr;
  list->cut = 0;
  if (v < g.n_base && (raw_length & kReplaced) == 0) {
    const int64_t start = g.indptr[v], end = g.indptr[v + 1];
    if (end < start || start < 0 || end > g.num_indices) return ListError::kIndptr;
    cut = (raw_length >> kCutShift) & kCutMask;
    if (cut > end - start) return ListError::kOverlay;
    list->base = g.indices + start;
    list->base_count = end - start - cut;
    list->cut = cut;
  }
  list->tail = g.tail;
  list->degree = list->base_count;
  if (g.tail_start && g.tail_start[v] >= 0) {
    const int64_t start = g.tail_start[v], length = raw_length & kLengthMask;
    if (start + 2 * cut + length > g.tail_capacity) return ListError::kOverlay;
    list->pairs = g.tail + start;
    list->tail = g.tail + start + 2 * cut;
    list->degree += length;
  } else if (list->cut) {
    return ListError::kOverlay;
  }
  return ListError::kNone;
}

// Pass 1: each frontier node's list and sample size (exclusive prefix sum in offset).
void plan_hop(const LivingGraph& g, const int64_t* frontier, int64_t width, int64_t k,
              NodeList* lists, int64_t* offset) {
  std::atomic<int64_t> bad_node{-1};
  std::atomic<int64_t> bad_indptr{-1};
  std::atomic<int64_t> bad_overlay{-1};
  std::atomic<int64_t> huge_node{-1};
  parallel_chunks(width, 2048, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t v = frontier[i];
      offset[i + 1] = 0;
      if (v < 0 || v >= g.num_nodes) {
        bad_node.store(v);
        continue;
      }
      const ListError error = node_list(g, v, lists + i);
      if (error != ListError::kNone) {
        (error == ListError::kIndptr ? bad_indptr : bad_overlay).store(v);
        continue;
      }
      const int64_t degree = lists[i].degree;
      offset[i + 1] = (k < 0 || degree <= k) ? degree : k;
      if (offset[i + 1] != degree && degree >= kMaxSampledDegree) huge_node.store(v);
    }
  });
  TORCH_CHECK_INDEX(bad_node.load() == -1, "cpu_sampler: node id ", bad_node.load(),
                    " is outside [0, ", g.num_nodes, ")");
  TORCH_CHECK_VALUE(bad_indptr.load() == -1, "cpu_sampler: indptr is not a valid CSC at node ",
                    bad_indptr.load());
  TORCH_CHECK_VALUE(bad_overlay.load() == -1, "cpu_sampler: the overlay tail of node ",
                    bad_overlay.load(), " runs past the tail's ", g.tail_capacity, " entries");
  TORCH_CHECK_VALUE(huge_node.load() == -1, "cpu_sampler: node ", huge_node.load(),
                    " has 2**31 or more neighbours, beyond the sampling spec's range");
  offset[0] = 0;
  for (int64_t i = 0; i < width; ++i) offset[i + 1] += offset[i];
}

// Writes node i's sampled neighbours: its whole list in list order, or the drawn offsets.
inline void copy_list(const NodeList& list, int64_t count, int64_t k, const int64_t* chosen,
                      int64_t* out) {
  if (count == list.degree) {
    const int64_t from_base = std::min(count, list.base_count);
    if (from_base > 0) std::memcpy(out, list.base, sizeof(int64_t) * from_base);
    for (int64_t c = 0; c < list.cut; ++c) {  // pairs at places >= base_count are spent
      if (list.pairs[2 * c] < from_base) out[list.pairs[2 * c]] = list.pairs[2 * c + 1];
    }
    if (count > from_base) {
      std::memcpy(out + from_base, list.tail, sizeof(int64_t) * (count - from_base));
    }
  } else {
    for (int64_t d = 0; d < k; ++d) out[d] = list[chosen[d]];
  }
}

// Sample one hop for the frontier n_id[begin:end] (pass 1, prefix sum, pass 2).
HopEdges sample_hop(const LivingGraph& g, const std::vector<int64_t>& n_id, int64_t begin,
                    int64_t end, int64_t k, uint32_t base, uint32_t hop) {
  const int64_t width = end - begin;
  const int64_t* frontier = n_id.data() + begin;
  std::unique_ptr<NodeList[]> lists(new NodeList[std::max<int64_t>(width, 1)]);
  Buffer offset = make_buffer(width + 1);
  plan_hop(g, frontier, width, k, lists.get(), offset.get());

  HopEdges hop_edges{offset[width], make_buffer(offset[width]), make_buffer(offset[width])};
  const uint32_t hop_term = hop * kHopMul;
  const int64_t slot = std::max<int64_t>(k, 1);
  parallel_chunks(width, grain_nodes(k), [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> draws(2 * slot);  // double buffer: node i and node i + 1
    std::vector<int64_t> scratch;
    // Draw node i+1's offsets and prefetch those neighbours, then copy out node i's: the reads
    // miss cache on big graphs, and drawing the next node meanwhile hides their latency.
    auto draw = [&](int64_t i, int64_t* chosen) {
      const NodeList& list = lists[i];
      if (offset[i + 1] - offset[i] == list.degree) {
        const int64_t ahead = std::min<int64_t>(list.degree, 64);
        for (int64_t b = 0; b < ahead; b += 8) __builtin_prefetch(list.address(b));
        return;
      }
      floyd_select(list.degree, k, node_hash(base, hop_term, frontier[i]), chosen, scratch);
      for (int64_t d = 0; d < k; ++d) __builtin_prefetch(list.address(chosen[d]));
    };
    auto emit = [&](int64_t i, const int64_t* chosen) {
      const int64_t count = offset[i + 1] - offset[i];
      copy_list(lists[i], count, k, chosen, hop_edges.nbr.get() + offset[i]);
      std::fill_n(hop_edges.owner.get() + offset[i], count, begin + i);
    };
    draw(lo, draws.data());
    for (int64_t i = lo; i < hi; ++i) {
      if (i + 1 < hi) draw(i + 1, draws.data() + ((i + 1 - lo) & 1) * slot);
      emit(i, draws.data() + ((i - lo) & 1) * slot);
    }
  });
  return hop_edges;
}

using OptionalTensor = std::optional<at::Tensor>;

// The overlay arguments of sample_neighbors as a LivingGraph (no tail_start: no overlay).
LivingGraph living_graph(const at::Tensor& indptr, const at::Tensor& indices,
                         const OptionalTensor& tail_start_arg,
                         const OptionalTensor& tail_length_arg, const OptionalTensor& tail_arg,
                         int64_t n_base, int64_t num_nodes) {
  LivingGraph g{indptr.data_ptr<int64_t>(), indices.data_ptr<int64_t>(), indices.numel(),
                indptr.numel() - 1, indptr.numel() - 1};
  if (!tail_start_arg.has_value()) {
    TORCH_CHECK_VALUE(n_base < 0 || (n_base == g.n_base && num_nodes == g.n_base),
                      "cpu_sampler: without an overlay n_base and num_nodes are the CSC's ",
                      g.n_base, " nodes");
    return g;
  }
  TORCH_CHECK_VALUE(tail_length_arg.has_value() && tail_arg.has_value(),
                    "cpu_sampler: an overlay needs tail_start, tail_length and tail");
  const at::Tensor& tail_start = *tail_start_arg;
  const at::Tensor& tail_length = *tail_length_arg;
  const at::Tensor& tail = *tail_arg;
  for (const at::Tensor* t : {&tail_start, &tail_length, &tail}) {
    TORCH_CHECK_TYPE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                     t->is_contiguous(), "cpu_sampler: overlay tensors must be contiguous 1-D "
                     "int64 CPU tensors (they are read in place)");
  }
  TORCH_CHECK_VALUE(n_base == g.n_base, "cpu_sampler: the overlay's n_base=", n_base,
                    " but the CSC has ", g.n_base, " nodes");
  TORCH_CHECK_VALUE(num_nodes >= n_base && num_nodes <= tail_start.numel() &&
                    tail_length.numel() == tail_start.numel(), "cpu_sampler: overlay of ",
                    num_nodes, " nodes does not fit its start/length arrays of ",
                    tail_start.numel(), " and ", tail_length.numel());
  g.num_nodes = num_nodes;
  g.tail_start = tail_start.data_ptr<int64_t>();
  g.tail_length = tail_length.data_ptr<int64_t>();
  g.tail = tail.data_ptr<int64_t>();
  g.tail_capacity = tail.numel();
  return g;
}

}  // namespace

namespace {

// The hops' edges as one [2, E] tensor: rows (local neighbour ids), then cols (owners).
at::Tensor concat_edges(const std::vector<HopEdges>& hops) {
  int64_t total_edges = 0;
  for (const HopEdges& hop : hops) total_edges += hop.num_edges;
  at::Tensor edge_index = torch::empty({2, total_edges}, torch::kInt64);
  int64_t* rows = edge_index.data_ptr<int64_t>();
  int64_t* cols = rows + total_edges;
  for (const HopEdges& hop : hops) {
    std::memcpy(rows, hop.nbr.get(), sizeof(int64_t) * hop.num_edges);
    std::memcpy(cols, hop.owner.get(), sizeof(int64_t) * hop.num_edges);
    rows += hop.num_edges;
    cols += hop.num_edges;
  }
  return edge_index;
}

}  // namespace

// Returns (n_id, edge_index [2, E], seed_index, num_sampled_nodes, num_sampled_edges).
// The overlay (quiver_serve/graph/overlay_view.py) is tail_start / tail_length / tail (its
// start, length and tail) over n_base base nodes, num_nodes nodes in all; leave them out (None)
// to sample the base alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>, std::vector<int64_t>>
sample_neighbors(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& seeds,
                 const std::vector<int64_t>& fanouts, int64_t seed,
                 const OptionalTensor& tail_start, const OptionalTensor& tail_length,
                 const OptionalTensor& tail, int64_t n_base, int64_t num_nodes) {
  check_csc(indptr, indices);
  TORCH_CHECK_TYPE(seeds.device().is_cpu() && seeds.scalar_type() == at::kLong && seeds.dim() == 1,
                   "cpu_sampler: seeds must be a 1-D int64 CPU tensor");
  TORCH_CHECK_VALUE(seed >= 0, "cpu_sampler: seed must be non-negative, got ", seed);
  const LivingGraph graph =
      living_graph(indptr, indices, tail_start, tail_length, tail, n_base, num_nodes);
  num_nodes = graph.num_nodes;
  const at::Tensor seeds_c = seeds.contiguous();  // request-sized, copying it is free
  const int64_t* seed_ptr = seeds_c.data_ptr<int64_t>();
  const int64_t num_seeds = seeds_c.numel();
  const uint32_t base = seed_base(static_cast<uint64_t>(seed));

  std::vector<int64_t> n_id;
  std::vector<int64_t> seed_index(num_seeds);
  LocalIdMap local_of;
  local_of.reserve(num_seeds, n_id);
  for (int64_t i = 0; i < num_seeds; ++i) {
    const int64_t v = seed_ptr[i];
    TORCH_CHECK_INDEX(v >= 0 && v < num_nodes, "cpu_sampler: seed node ", v, " is outside [0, ",
                      num_nodes, ")");
    seed_index[i] = local_of.find_or_insert(v, static_cast<int64_t>(n_id.size()));
    if (seed_index[i] == static_cast<int64_t>(n_id.size())) n_id.push_back(v);
  }

  std::vector<int64_t> num_sampled_nodes{static_cast<int64_t>(n_id.size())};
  std::vector<int64_t> num_sampled_edges;
  std::vector<HopEdges> hops;
  int64_t frontier_begin = 0;
  for (size_t h = 0; h < fanouts.size(); ++h) {
    const int64_t frontier_end = static_cast<int64_t>(n_id.size());
    hops.push_back(sample_hop(graph, n_id, frontier_begin, frontier_end, fanouts[h], base,
                              static_cast<uint32_t>(h + 1)));
    int64_t* nbr = hops.back().nbr.get();
    const int64_t num_edges = hops.back().num_edges;
    local_of.reserve(std::min(frontier_end + num_edges, num_nodes), n_id);
    constexpr int64_t kAhead = 16;  // table probes are cache misses on big samples
    for (int64_t e = 0; e < num_edges; ++e) {  // sequential: defines first-occurrence order
      if (e + kAhead < num_edges) local_of.prefetch(nbr[e + kAhead]);
      const int64_t next = static_cast<int64_t>(n_id.size());
      const int64_t global = nbr[e];
      nbr[e] = local_of.find_or_insert(global, next);
      if (nbr[e] == next) n_id.push_back(global);
    }
    num_sampled_nodes.push_back(static_cast<int64_t>(n_id.size()) - frontier_end);
    num_sampled_edges.push_back(num_edges);
    frontier_begin = frontier_end;
  }
  at::Tensor edge_index = concat_edges(hops);
  return {vector_to_tensor(std::move(n_id)), edge_index, vector_to_tensor(std::move(seed_index)),
          num_sampled_nodes, num_sampled_edges};
}

uint32_t seed_base_py(int64_t seed) { return seed_base(static_cast<uint64_t>(seed)); }

// One hop of one relation of a typed graph (quiver_serve/sampling/typed.py): the CSC positions
// the hop reads for `frontier` (global ids of the relation's destination type), in frontier
// order, and how many per frontier node. `base` is the relation's batch base
// (sampling/base.py, relation_base), so the draws are the reference's hop_edge_positions'.
std::tuple<at::Tensor, at::Tensor> hop_positions(const at::Tensor& indptr,
                                                 const at::Tensor& indices,
                                                 const at::Tensor& frontier, int64_t k,
                                                 int64_t base, int64_t hop) {
  check_csc(indptr, indices);
  TORCH_CHECK_TYPE(frontier.device().is_cpu() && frontier.scalar_type() == at::kLong &&
                   frontier.dim() == 1, "cpu_sampler: frontier must be a 1-D int64 CPU tensor");
  TORCH_CHECK_VALUE(base >= 0 && base <= 0xFFFFFFFFLL && hop >= 1,
                    "cpu_sampler: base must be a 32-bit value and hop >= 1");
  const LivingGraph g{indptr.data_ptr<int64_t>(), indices.data_ptr<int64_t>(), indices.numel(),
                      indptr.numel() - 1, indptr.numel() - 1};
  const at::Tensor nodes = frontier.contiguous();
  const int64_t width = nodes.numel();
  std::unique_ptr<NodeList[]> lists(new NodeList[std::max<int64_t>(width, 1)]);
  Buffer offset = make_buffer(width + 1);
  plan_hop(g, nodes.data_ptr<int64_t>(), width, k, lists.get(), offset.get());
  at::Tensor positions = torch::empty({offset[width]}, torch::kInt64);
  at::Tensor counts = torch::empty({width}, torch::kInt64);
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* frontier_ptr = nodes.data_ptr<int64_t>();
  const uint32_t hop_term = static_cast<uint32_t>(hop) * kHopMul;
  parallel_chunks(width, grain_nodes(k), [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> chosen(std::max<int64_t>(k, 1));
    std::vector<int64_t> scratch;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t start = lists[i].base - g.indices;
      const int64_t n = offset[i + 1] - offset[i];
      count[i] = n;
      if (n == lists[i].degree) {
        for (int64_t d = 0; d < n; ++d) pos[offset[i] + d] = start + d;
        continue;
      }
      floyd_select(lists[i].degree, k, node_hash(static_cast<uint32_t>(base), hop_term,
                                                 frontier_ptr[i]), chosen.data(), scratch);
      for (int64_t d = 0; d < k; ++d) pos[offset[i] + d] = start + chosen[d];
    }
  });
  return {positions, counts};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "quiver-serve CPU neighbour sampler (C++ twin of sampling/reference.py)";
  m.def("sample_neighbors", &sample_neighbors,
        "Sample a len(fanouts)-hop subgraph; see quiver_serve/sampling/base.py",
        py::arg("indptr"), py::arg("indices"), py::arg("seeds"), py::arg("fanouts"),
        py::arg("seed"), py::arg("tail_start") = py::none(), py::arg("tail_length") = py::none(),
        py::arg("tail") = py::none(), py::arg("n_base") = -1, py::arg("num_nodes") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("hop_positions", &hop_positions,
        "One hop of one typed relation: (CSC positions, count per frontier node)",
        py::arg("indptr"), py::arg("indices"), py::arg("frontier"), py::arg("k"),
        py::arg("base"), py::arg("hop"), py::call_guard<py::gil_scoped_release>());
  m.def("seed_base", &seed_base_py, "The 32-bit batch base of a seed (exposed for tests)");
}
