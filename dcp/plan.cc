#include "dcp/plan.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dcp/collectives.h"

namespace fsdp::dcp::internal {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

Box WholeBox(const std::vector<int64_t>& sizes) {
  return Box{std::vector<int64_t>(sizes.size(), 0), std::vector<int64_t>(sizes.size(), 0), sizes};
}

std::vector<Box> RunBoxes(const std::vector<std::vector<dtensor::Segment>>& runs) {
  const size_t dims = runs.size();
  std::vector<Box> out;
  for (const auto& r : runs) {
    if (r.empty()) return out;
  }
  std::vector<size_t> pick(dims, 0);  // one run per dim: an odometer over the runs
  while (true) {
    Box box;
    for (size_t k = 0; k < dims; ++k) {
      int64_t local = 0;
      for (size_t j = 0; j < pick[k]; ++j) local += runs[k][j].length;
      box.global_offsets.push_back(runs[k][pick[k]].start);
      box.local_offsets.push_back(local);
      box.sizes.push_back(runs[k][pick[k]].length);
    }
    if (box.numel() > 0) out.push_back(std::move(box));
    size_t k = dims;
    while (k > 0 && ++pick[k - 1] == runs[k - 1].size()) pick[--k] = 0;
    if (k == 0) break;
  }
  return out;
}

namespace {

// Appends the boxes of elements [lo, hi) of the sub-tensor at `prefix` (the indices of dims
// before `dim`), in row-major order.
void AppendFlatBoxes(const std::vector<int64_t>& global, size_t dim, std::vector<int64_t>& prefix, int64_t lo,
                     int64_t hi, int64_t& local_offset, std::vector<Box>& out) {
  if (lo >= hi) return;
  int64_t inner = 1;
  for (size_t k = dim + 1; k < global.size(); ++k) inner *= global[k];
  const auto emit = [&](int64_t first, int64_t count) {  // rows [first, first + count) of `dim`, whole below
    Box box;
    box.global_offsets = prefix;
    box.global_offsets.push_back(first);
    box.sizes = std::vector<int64_t>(prefix.size(), 1);
    box.sizes.push_back(count);
    for (size_t k = dim + 1; k < global.size(); ++k) {
      box.global_offsets.push_back(0);
      box.sizes.push_back(global[k]);
    }
    box.flat_local_offset = local_offset;
    local_offset += box.numel();
    out.push_back(std::move(box));
  };
  const auto descend = [&](int64_t row, int64_t from, int64_t to) {  // part of one row
    prefix.push_back(row);
    AppendFlatBoxes(global, dim + 1, prefix, from, to, local_offset, out);
    prefix.pop_back();
  };
  int64_t first_row = lo / inner;
  const int64_t end_row = hi / inner;  // rows before it are whole up to hi
  if (lo % inner != 0) {
    if (first_row == end_row) return descend(first_row, lo % inner, hi % inner);
    descend(first_row, lo % inner, inner);
    ++first_row;
  }
  if (end_row > first_row) emit(first_row, end_row - first_row);
  if (hi % inner != 0) descend(end_row, 0, hi % inner);
}

}  // namespace

std::vector<Box> FlatRangeBoxes(const std::vector<int64_t>& global, int64_t flat_start, int64_t numel) {
  int64_t total = 1;
  for (int64_t s : global) total *= s;
  TORCH_CHECK(flat_start >= 0 && numel >= 0 && flat_start + numel <= total, "FlatRangeBoxes: elements [", flat_start,
              ", ", flat_start + numel, ") outside a tensor of size ", c10::str(c10::IntArrayRef(global)));
  std::vector<Box> out;
  if (numel == 0) return out;
  if (global.empty()) {  // 0-d: one element
    Box box;
    box.flat_local_offset = 0;
    out.push_back(std::move(box));
    return out;
  }
  std::vector<int64_t> prefix;
  int64_t local_offset = 0;
  AppendFlatBoxes(global, 0, prefix, flat_start, flat_start + numel, local_offset, out);
  return out;
}

at::Tensor BoxOf(const at::Tensor& local, const Box& box) {
  if (box.flat_local_offset >= 0) return local.narrow(0, box.flat_local_offset, box.numel()).view(box.sizes);
  at::Tensor t = local;
  for (size_t d = 0; d < box.sizes.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), box.local_offsets[d], box.sizes[d]);
  return t;
}

std::string ChunkKey(const std::string& fqn, const std::vector<int64_t>& offsets) {
  return absl::StrCat("T", fqn, "\n", absl::StrJoin(offsets, ","));
}

std::string BytesKey(const std::string& fqn) { return absl::StrCat("B", fqn); }

std::vector<std::vector<bool>> DedupSavePlans(const std::vector<std::vector<PlannedItem>>& plans) {
  struct Key {
    std::vector<std::pair<size_t, size_t>> holders;  // (plan, item), plans ascending
    int64_t size = 0;
  };
  std::vector<Key> keys;  // in first-appearance order
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t p = 0; p < plans.size(); ++p) {
    for (size_t i = 0; i < plans[p].size(); ++i) {
      auto [it, added] = index.emplace(plans[p][i].key, keys.size());
      if (added) keys.emplace_back();
      Key& k = keys[it->second];
      k.holders.emplace_back(p, i);
      k.size = plans[p][i].is_bytes ? 0 : plans[p][i].storage_size;
    }
  }
  std::vector<std::vector<bool>> keep(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) keep[p].assign(plans[p].size(), false);
  std::vector<int64_t> plan_size(plans.size(), 0);
  for (const Key& k : keys) {
    size_t best = k.holders.front().first;  // min(plan_indices, key=plan_to_size): ties to the lowest
    for (const auto& [p, i] : k.holders) {
      if (plan_size[p] < plan_size[best]) best = p;
    }
    plan_size[best] += k.size > 0 ? k.size : 1;
    for (const auto& [p, i] : k.holders) {
      if (p == best) keep[p][i] = true;
    }
  }
  return keep;
}

namespace {

void PutU64(std::vector<char>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

class Reader {
 public:
  Reader(const std::vector<char>& bytes, const std::string& source) : bytes_(bytes), source_(source) {}
  uint64_t U64() {
    Need(8, "an integer");
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return v;
  }
  std::string Str() {
    const uint64_t n = U64();
    Need(n, "a string");
    std::string s(bytes_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  bool AtEnd() const { return pos_ == bytes_.size(); }

 private:
  void Need(uint64_t n, const char* what) {
    TORCH_CHECK(n <= bytes_.size() - pos_, source_, " is not a valid save plan: ", what, " at byte ", pos_, " needs ",
                n, " bytes, ", bytes_.size() - pos_, " are left");
  }
  const std::vector<char>& bytes_;
  const std::string& source_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<char> EncodePlan(const std::vector<PlannedItem>& plan) {
  std::vector<char> out;
  PutU64(out, plan.size());
  for (const PlannedItem& item : plan) {
    PutU64(out, item.key.size());
    out.insert(out.end(), item.key.begin(), item.key.end());
    PutU64(out, static_cast<uint64_t>(item.storage_size));
    PutU64(out, item.is_bytes ? 1 : 0);
  }
  return out;
}

std::vector<PlannedItem> DecodePlan(const std::vector<char>& bytes, const std::string& source) {
  Reader in(bytes, source);
  const uint64_t n = in.U64();
  TORCH_CHECK(n <= bytes.size(), source, " is not a valid save plan: it claims ", n, " items in ", bytes.size(),
              " bytes");
  std::vector<PlannedItem> plan(n);
  for (PlannedItem& item : plan) {
    item.key = in.Str();
    item.storage_size = static_cast<int64_t>(in.U64());
    item.is_bytes = in.U64() != 0;
  }
  TORCH_CHECK(in.AtEnd(), source, " is not a valid save plan: bytes follow its last item");
  return plan;
}

std::vector<char> DedupOverWorld(const comm::ProcessGroupPtr& world, const std::string& error,
                                 const std::vector<PlannedItem>& mine, const char* caller) {
  const int rank = world ? world->rank() : 0;
  const auto all = GatherOrThrow(world, error, EncodePlan(mine), 0, caller);
  std::vector<std::vector<char>> keeps;
  const std::string dedup_error = ErrorOf([&] {
    if (rank != 0) return;
    std::vector<std::vector<PlannedItem>> plans;
    for (size_t r = 0; r < all.size(); ++r) {
      plans.push_back(r == 0 ? mine : DecodePlan(all[r], absl::StrCat("rank ", r, "'s plan")));
    }
    for (const std::vector<bool>& k : DedupSavePlans(plans)) keeps.emplace_back(k.begin(), k.end());
  });
  std::vector<char> keep = ScatterOrThrow(world, dedup_error, keeps, 0, caller);
  TORCH_CHECK(keep.size() == mine.size(), caller, ": rank 0 sent ", keep.size(), " decisions for ", mine.size(),
              " items");
  return keep;
}

}  // namespace fsdp::dcp::internal
