#include "settings.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace torch_pipeline {
namespace settings {

std::optional<std::string> env_text(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return std::nullopt;
  }
  return std::string(text);
}

std::string env_choice(const char* name, std::initializer_list<const char*> allowed,
                       const char* fallback) {
  const auto text = env_text(name);
  if (!text.has_value()) {
    return fallback;
  }
  std::ostringstream list;
  for (const char* a : allowed) {
    if (*text == a) {
      return *text;
    }
    list << (list.tellp() > 0 ? ", " : "") << "'" << a << "'";
  }
  TORCH_CHECK_VALUE(false, name, "='", *text, "' is not a valid setting: expected one of ",
                    list.str(), " (or unset for '", fallback, "')");
}

int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const auto text = env_text(name);
  if (!text.has_value()) {
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text->c_str(), &end, 10);
  TORCH_CHECK_VALUE(
      errno == 0 && end != text->c_str() && *end == '\0' && value >= lo && value <= hi, name, "='",
      *text, "' is not a valid setting: expected an integer in [", lo, ", ", hi, "]");
  return value;
}

std::optional<double> env_seconds(const char* name) {
  const auto text = env_text(name);
  if (!text.has_value()) {
    return std::nullopt;
  }
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text->c_str(), &end);
  TORCH_CHECK_VALUE(errno == 0 && end != text->c_str() && *end == '\0' && value >= 0, name, "='",
                    *text, "' is not a valid setting: expected a number of seconds >= 0");
  return value;
}

bool env_flag(const char* name, bool fallback) {
  const auto text = env_text(name);
  if (!text.has_value()) {
    return fallback;
  }
  const std::string& t = *text;
  if (t == "1" || t == "true" || t == "on") {
    return true;
  }
  if (t == "0" || t == "false" || t == "off") {
    return false;
  }
  TORCH_CHECK_VALUE(false, name, "='", t,
                    "' is not a valid setting: expected 0 or 1 (also false/true, off/on)");
}

}  // namespace settings
}  // namespace torch_pipeline
