// CPU self-test of common.h: LCG jump-ahead against step-by-step iteration, percentiles, layouts.
#include <cstdio>
#include <initializer_list>
#include "common.h"

static int passed = 0, failed = 0;
#define CHECK(cond, what)                                  \
  do {                                                     \
    if (cond) {                                            \
      ++passed;                                            \
    } else {                                               \
      ++failed;                                            \
      std::printf("FAIL %s (line %d)\n", what, __LINE__);  \
    }                                                      \
  } while (0)

int main() {
  using namespace valve;
  for (uint32_t slot = 0; slot < 4; ++slot) {
    for (uint64_t n : {0ull, 1ull, 2ull, 7ull, 1000ull, 123457ull}) {
      uint32_t x = lcg_seed(slot, 3), y = x;
      for (uint64_t i = 0; i < n; ++i) y = y * kLcgA + kLcgC;
      CHECK(lcg_jump(x, n) == y, "jump-ahead equals iteration");
    }
  }
  CHECK(lcg_jump(5, 3) != lcg_jump(5, 4), "different step counts differ");
  CHECK(lcg_seed(0, 1) != lcg_seed(1, 0), "seeds differ per slot/thread");
  double s[100];
  for (int i = 0; i < 100; ++i) s[i] = i + 1;
  CHECK(percentile(s, 100, 0.5) == 50.0, "p50");
  CHECK(percentile(s, 100, 0.99) == 99.0, "p99");
  CHECK(percentile(s, 1, 0.99) == 1.0, "single sample");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
