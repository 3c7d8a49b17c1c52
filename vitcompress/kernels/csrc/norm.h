// A float row's Euclidean norm, shared by the fused kernels (select_squeeze.cpp, tome_merge.cpp).
// kernels/ops.py builds each extension under a name that hashes its source and this header, so
// an edit here rebuilds both (cpp_extension itself hashes only the sources it is given).
#pragma once

#include <cmath>
#include <cstdint>

namespace vitcompress {

// Eight partial sums, so that the compiler can vectorise the loop without reordering a single
// floating-point sum (which it may not do on its own).
inline float norm_of(const float* row, int64_t c) {
  float partial[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    for (int lane = 0; lane < 8; ++lane) partial[lane] += row[i + lane] * row[i + lane];
  }
  float sum = 0.f;
  for (; i < c; ++i) sum += row[i] * row[i];
  for (int lane = 0; lane < 8; ++lane) sum += partial[lane];
  return std::sqrt(sum);
}

}  // namespace vitcompress
