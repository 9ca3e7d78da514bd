// The sim device's names for the torch-free race checker (csrc/core/race_checker.h), which lives
// in the core so that it is built and tested (GoogleTest, ASan, TSan) without torch.
#pragma once

#include "../core/race_checker.h"

namespace torch_pipeline {
namespace sim {

using core::Access;
using core::AccessSite;
using core::clock_entry;
using core::kHost;
using core::Race;
using core::RaceChecker;
using core::Site;
using core::Timeline;
using core::VectorClock;

}  // namespace sim
}  // namespace torch_pipeline
