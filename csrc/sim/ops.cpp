#include "ops.h"

#include <algorithm>
#include <utility>

namespace torch_pipeline {
namespace sim {

// ---- byte ranges -------------------------------------------------------------------------------
void add_accesses(const at::Tensor& t, bool write, const std::string& memory,
                  std::vector<Access>& out) {
  if (!t.defined() || !t.has_storage()) {
    return;
  }
  if (t.is_nested()) {
    // A NestedTensorImpl has no sizes or strides, only its constituents' over one buffer, its
    // storage: the whole buffer is what it touches.
    const auto base = reinterpret_cast<uintptr_t>(t.storage().data());
    if (base == 0 || t.storage().nbytes() == 0) {
      return;
    }
    Access a;
    a.begin = base;
    a.end = base + t.storage().nbytes();
    a.write = write;
    a.memory = memory;
    out.push_back(std::move(a));
    return;
  }
  const int64_t numel = t.numel();
  if (numel == 0) {
    return;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.storage().data());
  if (base == 0) {
    return;
  }
  const auto item = static_cast<int64_t>(t.element_size());
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const int64_t offset = t.storage_offset();
  const int64_t ndim = t.dim();
  // In elements of the storage: [begin, end).
  auto push = [&](int64_t begin, int64_t end) {
    Access a;
    a.begin = base + static_cast<uintptr_t>(begin * item);
    a.end = base + static_cast<uintptr_t>(end * item);
    a.write = write;
    a.memory = memory;
    out.push_back(std::move(a));
  };
  // The bounding range: every element lies in [lo, hi].
  int64_t lo = offset;
  int64_t hi = offset;
  for (int64_t d = 0; d < ndim; ++d) {
    if (sizes[d] != 1) {
      const int64_t extent = (sizes[d] - 1) * strides[d];
      (extent >= 0 ? hi : lo) += extent;
    }
  }
  if (t.is_non_overlapping_and_dense()) {
    push(lo, hi + 1);
    return;
  }
  // The innermost dims that form contiguous runs of `run` elements: dims [k+1, ndim).
  int64_t k = ndim - 1;
  int64_t run = 1;
  while (k >= 0 && (sizes[k] == 1 || strides[k] == run)) {
    run *= sizes[k];
    --k;
  }
  // Each run starts at an index of dims [0, k] and covers `span` elements from there. Too many
  // runs: the innermost of those dims joins the span (its bounding range), exact in the others.
  int64_t span = run;
  int64_t runs = numel / run;
  while (runs > kMaxRuns && k >= 0) {
    if (sizes[k] != 1) {
      if (strides[k] < 0) {
        push(lo, hi + 1);
        return;
      }
      span += (sizes[k] - 1) * strides[k];
      runs /= sizes[k];
    }
    --k;
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  ranges.reserve(static_cast<size_t>(runs));
  std::vector<int64_t> index(static_cast<size_t>(k + 1), 0);
  int64_t start = offset;
  for (int64_t r = 0; r < runs; ++r) {
    ranges.emplace_back(start, start + span);
    for (int64_t j = k; j >= 0; --j) {  // the next index, odometer order
      if (++index[static_cast<size_t>(j)] < sizes[j]) {
        start += strides[j];
        break;
      }
      index[static_cast<size_t>(j)] = 0;
      start -= (sizes[j] - 1) * strides[j];
    }
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t b = ranges.front().first;
  int64_t e = ranges.front().second;
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first <= e) {
      e = std::max(e, ranges[i].second);
    } else {
      push(b, e);
      b = ranges[i].first;
      e = ranges[i].second;
    }
  }
  push(b, e);
}

void copy_math_bits(const at::Tensor& from, c10::TensorImpl* to) {
  if (from.is_conj()) {
    to->_set_conj(true);
  }
  if (from.is_neg()) {
    to->_set_neg(true);
  }
}

}  // namespace sim
}  // namespace torch_pipeline
