// Settings read from the environment: one place, one error format. A bad value is a ValueError
// that names the variable, the value and what is allowed; nothing is read at static
// initialisation (a throw there would abort the import), callers read on first use.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace torch_pipeline {
namespace settings {

// The value of `name` if it is set and not empty.
std::optional<std::string> env_text(const char* name);

// One of `allowed`, or `fallback` when unset; any other value raises ValueError listing `allowed`.
std::string env_choice(const char* name, std::initializer_list<const char*> allowed,
                       const char* fallback);

// An integer in [lo, hi], or `fallback` when unset; anything else raises ValueError.
int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback);

// A positive number of seconds (fractions allowed), or nullopt when unset.
std::optional<double> env_seconds(const char* name);

// "0"/"1" (also "false"/"true", "off"/"on"), or `fallback` when unset.
bool env_flag(const char* name, bool fallback);

}  // namespace settings
}  // namespace torch_pipeline
