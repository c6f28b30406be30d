// Run-time SIMD level for the CPU kernels. One build serves every x86-64 (and aarch64): the wide paths are
// compiled with per-function target attributes and picked here from what the CPU reports, so no -march
// flag is needed and an AVX2-only machine never executes an AVX-512 instruction.
//
// PYPARALLEL_SIMD=avx512|avx2|scalar (or auto) forces a level; set_level() changes it at run time (tests
// use it to compare the paths). Asking for a level the CPU lacks is an error naming what it does have.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace pyparallel {
namespace simd {

enum class Level : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* name(Level level) {
  switch (level) {
    case Level::kAvx512: return "avx512";
    case Level::kAvx2: return "avx2";
    default: return "scalar";
  }
}

#if defined(__x86_64__)
// F16C (half <-> float conversions) has no __builtin_cpu_supports name on older compilers: CPUID.1:ECX[29].
inline bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx >> 29) & 1u;
}
#endif

// Whether this CPU (and OS: libgcc checks XCR0 for the AVX state) can run `level`.
inline bool cpu_supports(Level level) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  switch (level) {
    case Level::kAvx512: return avx2 && __builtin_cpu_supports("avx512f");
    case Level::kAvx2: return avx2;
    default: return true;
  }
#else
  return level == Level::kScalar;
#endif
}

inline Level best_supported() {
  if (cpu_supports(Level::kAvx512)) return Level::kAvx512;
  if (cpu_supports(Level::kAvx2)) return Level::kAvx2;
  return Level::kScalar;
}

inline std::string supported_names() {
  std::string out;
  for (Level l : {Level::kAvx512, Level::kAvx2, Level::kScalar}) {
    if (!cpu_supports(l)) continue;
    if (!out.empty()) out += ", ";
    out += name(l);
  }
  return out;
}

// Parses "avx512" / "avx2" / "scalar" / "auto" ("" is auto) and checks the CPU can run it.
inline Level parse_checked(const std::string& text, const char* source) {
  Level level;
  if (text.empty() || text == "auto") return best_supported();
  if (text == "avx512") level = Level::kAvx512;
  else if (text == "avx2") level = Level::kAvx2;
  else if (text == "scalar") level = Level::kScalar;
  else TORCH_CHECK(false, source, "='", text, "' is not a SIMD level; use avx512, avx2, scalar or auto");
  TORCH_CHECK(cpu_supports(level), source, "='", text, "' but this CPU supports only: ", supported_names());
  return level;
}

inline std::atomic<int>& level_slot() {
  static std::atomic<int> slot{-1};  // -1: not chosen yet (read the environment on first use)
  return slot;
}

// The level the kernels use now: the forced one, else the environment's, else the best the CPU has.
inline Level active() {
  int v = level_slot().load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<Level>(v);
  const char* env = std::getenv("PYPARALLEL_SIMD");
  Level level = parse_checked(env ? env : "", "PYPARALLEL_SIMD");
  level_slot().store(static_cast<int>(level), std::memory_order_relaxed);
  return level;
}

// Forces a level ("auto" re-reads nothing: it picks the best the CPU has); returns the previous one.
inline std::string set_level(const std::string& text) {
  Level previous = active();
  Level level = parse_checked(text, "set_simd_level");
  level_slot().store(static_cast<int>(level), std::memory_order_relaxed);
  return name(previous);
}

}  // namespace simd
}  // namespace pyparallel
