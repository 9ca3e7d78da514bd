// One way to warn: c10's TORCH_WARN, which PyTorch turns into a Python UserWarning when the
// warning is raised under a call from Python (so `warnings.catch_warnings`, `pytest.warns` and
// `-W error` see it) and writes to stderr elsewhere. Every message starts with "torch_pipeline: ".
#pragma once

#include <string>

namespace torch_pipeline {

// Warns with `message`.
void warn(const std::string& message);

// Warns with `message` the first time `key` is seen in this process (e.g. an operator name);
// later calls with the same key do nothing. Thread-safe.
void warn_once(const std::string& key, const std::string& message);

}  // namespace torch_pipeline
