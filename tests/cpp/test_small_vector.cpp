// The inline-first vector of the core tracker's per-storage records (core/small_vector.h).
#include "core/small_vector.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

using torch_pipeline::core::SmallVector;

namespace {

std::vector<int> values(const SmallVector<std::shared_ptr<int>, 2>& v) {
  std::vector<int> out;
  for (const auto& p : v) out.push_back(*p);
  return out;
}

}  // namespace

TEST(SmallVector, KeepsOrderAcrossTheSpillToTheHeap) {
  SmallVector<std::shared_ptr<int>, 2> v;
  EXPECT_TRUE(v.empty());
  for (int i = 1; i <= 5; ++i) {
    v.push_back(std::make_shared<int>(i));
    EXPECT_EQ(v.size(), static_cast<size_t>(i));
  }
  EXPECT_EQ(values(v), (std::vector<int>{1, 2, 3, 4, 5}));
  for (auto& p : v) *p *= 10;  // (elements are mutable in place)
  EXPECT_EQ(values(v), (std::vector<int>{10, 20, 30, 40, 50}));
}

TEST(SmallVector, ClearReleasesWhatTheElementsHeld) {
  // The core tracker's readers share clock snapshots: a cleared record must not keep one alive.
  auto shared = std::make_shared<int>(7);
  SmallVector<std::shared_ptr<int>, 2> v;
  v.push_back(shared);
  EXPECT_EQ(shared.use_count(), 2);
  v.clear();
  EXPECT_EQ(shared.use_count(), 1);
  EXPECT_TRUE(v.empty());
  for (int i = 0; i < 3; ++i) v.push_back(shared);  // spilled
  EXPECT_EQ(shared.use_count(), 4);
  v.clear();
  EXPECT_EQ(shared.use_count(), 1);
  v.push_back(std::make_shared<int>(1));  // inline again after a clear
  EXPECT_EQ(values(v), (std::vector<int>{1}));
}
