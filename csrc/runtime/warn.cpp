#include "warn.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_set>

namespace torch_pipeline {

void warn(const std::string& message) { TORCH_WARN("torch_pipeline: ", message); }

void warn_once(const std::string& key, const std::string& message) {
  static std::mutex mutex;
  static auto* seen = new std::unordered_set<std::string>();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen->insert(key).second) {
      return;
    }
  }
  warn(message);
}

}  // namespace torch_pipeline
