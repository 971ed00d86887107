// CPU emulation tests of the project's CUDA kernels: runs the drivers test_pointwise.cpp,
// test_flat.cpp, test_attention.cpp and test_fp8.cpp, which #include the real kernels/*.cu files on top of
// shim.h (host stand-ins for the CUDA built-ins, runtime in shim.cpp) and compare every exported
// kernel with a double-precision reference, one line per check, after test_shim.cpp has checked
// the emulation's own failure detectors. Exits non-zero if any check fails.
//
// `cargo test -p model --test cuda_emulation` builds and runs it; by hand (from crates/model):
//   c++ -std=c++17 -O1 -pthread -I kernels/emulation kernels/emulation/*.cpp -o /tmp/kernel-emu
//   /tmp/kernel-emu [shim] [pointwise] [flat] [attention] [fp8]      (default: all)
// Environment: EMU_SEED=<n> picks other schedules; EMU_UCONTEXT=1 forces the portable (slow)
// ucontext thread switch.
#include <chrono>
#include <cstdio>
#include <cstring>

#include "harness.h"

void shim_checks();
void pointwise_checks();
void flat_checks();
void attention_checks();
void fp8_checks();

int main(int argc, char** argv) {
  struct Suite {
    const char* name;
    void (*run)();
  };
  const Suite suites[] = {{"shim", shim_checks},
                          {"pointwise", pointwise_checks},
                          {"flat", flat_checks},
                          {"attention", attention_checks},
                          {"fp8", fp8_checks}};
  for (int i = 1; i < argc; ++i) {
    bool known = false;
    for (const Suite& s : suites) known = known || std::strcmp(argv[i], s.name) == 0;
    if (!known) {
      std::fprintf(stderr, "unknown suite `%s` (shim, pointwise, flat, attention, fp8)\n", argv[i]);
      return 2;
    }
  }
  std::printf("CUDA kernel emulation: schedule seed %llu, %s thread switch\n",
              (unsigned long long)emu::seed(), emu::switch_kind());
  for (const Suite& s : suites) {
    bool selected = argc == 1;
    for (int i = 1; i < argc; ++i) selected = selected || std::strcmp(argv[i], s.name) == 0;
    if (!selected) continue;
    const auto t0 = std::chrono::steady_clock::now();
    std::printf("== %s\n", s.name);
    s.run();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("== %s: %.2f s\n", s.name, secs);
  }
  std::printf("%d checks, %d failed\n", harness::checks, harness::failures);
  return harness::failures == 0 && harness::checks > 0 ? 0 : 1;
}
