// select -> gather -> squeeze in one op, for TPS at inference (CPU).
//
// The same computation as vitcompress.method: split_by_score (a stable descending sort of the
// scores), gather_tokens for the kept (hosts) and the pruned (donors) tokens, then squeeze: each
// donor goes to the host of highest cosine similarity and is fused into it with the weight
// exp(similarity) next to the host's own e. The unfused path runs about twenty small ATen ops per
// location, each with its own pass over the tokens and its own allocation; here one pass per
// image gathers, one batched matrix product scores the matches, and one pass per image fuses.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

constexpr float kSelfWeight = 2.718281828459045f;  // exp(1): a token's similarity to itself
constexpr float kNormEps = 1e-6f;                  // added to a norm, as the reference code does

}  // namespace

using vitcompress::norm_of;

// x: (B, P + N, C); scores: (B, N). Returns the tokens (B, P + K, C) in x's dtype (prefix, then
// the kept tokens in descending score order, donors fused in when `squeeze`) and the kept
// tokens' indices along N (B, K).
std::vector<at::Tensor> select_squeeze(const at::Tensor& x_in, const at::Tensor& scores_in,
                                       int64_t prefix_tokens, int64_t keep_tokens, bool squeeze) {
  TORCH_CHECK(x_in.device().is_cpu() && scores_in.device().is_cpu(), "select_squeeze: CPU only");
  TORCH_CHECK(x_in.dim() == 3, "select_squeeze: x must be (B, N, C)");
  TORCH_CHECK(scores_in.dim() == 2, "select_squeeze: scores must be (B, N)");
  TORCH_CHECK(prefix_tokens >= 0 && prefix_tokens <= x_in.size(1),
              "select_squeeze: prefix_tokens out of range");
  const int64_t B = x_in.size(0), P = prefix_tokens, N = x_in.size(1) - prefix_tokens;
  const int64_t C = x_in.size(2), K = keep_tokens, R = N - keep_tokens;
  TORCH_CHECK(scores_in.size(0) == B && scores_in.size(1) == N,
              "select_squeeze: scores must have one entry per non-prefix token");
  TORCH_CHECK(K >= 1 && K <= N, "select_squeeze: keep_tokens out of range");

  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  // Scores are ordered in double precision: exact for float32 and float64 scores alike.
  const at::Tensor scores = scores_in.to(at::kDouble).contiguous();
  const bool fuse = squeeze && R > 0;
  at::Tensor order = at::empty({B, N}, x.options().dtype(at::kLong));
  at::Tensor out = at::empty({B, P + K, C}, x.options());
  at::Tensor donors = at::empty({fuse ? B : 0, R, C}, x.options());
  at::Tensor unit_hosts = at::empty({fuse ? B : 0, K, C}, x.options());
  const float* xp = x.data_ptr<float>();
  const double* sp = scores.data_ptr<double>();
  int64_t* op = order.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  float* dp = donors.data_ptr<float>();
  float* hp = unit_hosts.data_ptr<float>();
  const int64_t row = (P + N) * C;

  // Pass 1, per image: order the scores, copy prefix and kept tokens into the output, the pruned
  // tokens into `donors`, and the kept tokens divided by their norms into `unit_hosts`.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t* o = op + b * N;
      const double* s = sp + b * N;
      std::iota(o, o + N, int64_t{0});
      // Descending and stable, as torch.sort(descending=True, stable=True): ties keep N's order,
      // and NaN counts as the largest value (torch puts it first).
      std::stable_sort(o, o + N, [s](int64_t i, int64_t j) {
        if (std::isnan(s[i])) return !std::isnan(s[j]);
        if (std::isnan(s[j])) return false;
        return s[i] > s[j];
      });
      const float* xb = xp + b * row;
      float* ob = outp + b * (P + K) * C;
      std::memcpy(ob, xb, sizeof(float) * P * C);
      for (int64_t k = 0; k < K; ++k) {
        const float* token = xb + (P + o[k]) * C;
        std::memcpy(ob + (P + k) * C, token, sizeof(float) * C);
        if (fuse) {
          const float inv = 1.f / (norm_of(token, C) + kNormEps);
          float* unit = hp + (b * K + k) * C;
          for (int64_t c = 0; c < C; ++c) unit[c] = token[c] * inv;
        }
      }
      if (fuse) {
        for (int64_t r = 0; r < R; ++r) {
          std::memcpy(dp + (b * R + r) * C, xb + (P + o[K + r]) * C, sizeof(float) * C);
        }
      }
    }
  });

  if (fuse) {
    // Raw donor . unit host for every pair: the donor's own norm is constant along its row, so it
    // is divided out after the argmax (as method.squeeze.match_hosts_cosine does).
    const at::Tensor dots = at::bmm(donors, unit_hosts.transpose(1, 2));  // (B, R, K)
    const float* dot = dots.data_ptr<float>();
    // Pass 2, per image: host and weight of each donor, then y_j = x_j + sum_i c_i (x_i - x_j)
    // with c_i = w_i / (e + sum_{i->j} w_i), the hosts' original values on the right.
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> host(R);
      std::vector<float> weight(R), total(K), original(K * C);
      std::vector<char> touched(K);
      for (int64_t b = begin; b < end; ++b) {
        std::fill(total.begin(), total.end(), 0.f);
        std::fill(touched.begin(), touched.end(), 0);
        float* hosts = outp + (b * (P + K) + P) * C;
        for (int64_t r = 0; r < R; ++r) {
          const float* d = dot + (b * R + r) * K;
          // The first maximum, as torch.max, which also takes the first NaN as the maximum.
          int64_t best = 0;
          for (int64_t k = 1; k < K && !std::isnan(d[best]); ++k) {
            if (std::isnan(d[k]) || d[k] > d[best]) best = k;
          }
          const float similarity = d[best] / (norm_of(dp + (b * R + r) * C, C) + kNormEps);
          host[r] = best;
          weight[r] = std::exp(similarity);
          total[best] += weight[r];
          if (!touched[best]) {
            touched[best] = 1;
            std::memcpy(original.data() + best * C, hosts + best * C, sizeof(float) * C);
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t j = host[r];
          const float coefficient = weight[r] / (total[j] + kSelfWeight);
          const float* donor = dp + (b * R + r) * C;
          const float* x_j = original.data() + j * C;
          float* y_j = hosts + j * C;
          for (int64_t c = 0; c < C; ++c) y_j[c] += (donor[c] - x_j[c]) * coefficient;
        }
      }
    });
  }
  const at::Tensor keep_index = order.narrow(1, 0, K).contiguous();
  return {out.to(x_in.scalar_type()), keep_index};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("select_squeeze", &select_squeeze, "TPS select -> gather -> squeeze (CPU, inference)");
}
