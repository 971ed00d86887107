// Runtime of the CUDA emulation (see shim.h): the launch loop, the per-block fiber scheduler,
// __syncthreads / warp-shuffle barriers, fault reporting and the guard-zone checks.
//
// Fibers switch with a few instructions that save the callee-saved registers and swap stacks
// (x86-64 and aarch64); elsewhere, or when x86 shadow stacks are active (a plain stack swap would
// trip them), with ucontext's swapcontext, which is correct everywhere but makes a system call
// per switch (about 25x slower).
#include "shim.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__aarch64__)
#define EMU_REGISTER_SWITCH 1
// Saves the callee-saved registers on the current stack, stores its stack pointer in *from and
// resumes the stack `to` (saved the same way, or prepared by prepare_stack).
extern "C" void emu_switch(void** from, void* to);
#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl emu_switch\n"
    ".type emu_switch, @function\n"
    "emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");
#else
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl emu_switch\n"
    ".type emu_switch, %function\n"
    "emu_switch:\n"
    "  sub sp, sp, #160\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mov x2, sp\n"
    "  str x2, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #160\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");
#endif
#endif

namespace emu {
namespace {

constexpr unsigned MAX_THREADS = 1024;        // per block, as on the GPU
constexpr unsigned MAX_DYN_SMEM = 48 * 1024;  // default limit (the launchers never opt in to more)
constexpr size_t STACK_BYTES = 256 * 1024;    // per fiber; the lowest page is a guard page

enum class State : unsigned char { Ready, AtSyncthreads, AtShuffle, Exited };

struct Fiber {
  void* sp;        // saved stack pointer (register switch)
  ucontext_t ctx;  // saved context (ucontext switch)
  State state;
};

// One warp's shuffle exchange: lanes write slot [parity][lane], wait for all 32, read their
// partner's slot. Alternating parity makes one barrier per shuffle enough: a lane can only write
// the same parity again after the next exchange completed, i.e. after everyone read this one.
struct Warp {
  unsigned arrived, parity;
  uint64_t value[2][32];
  int offset[2][32];
  unsigned size[2][32];
};

struct Region {
  unsigned char* base;  // start of the leading guard
  size_t bytes;         // payload between the guards
  const char* name;
};

struct Runtime {
  bool initialised = false;
  bool registers = false;  // register switch, else ucontext
  uint64_t rng = 0;
  char* stacks = nullptr;
  std::vector<Fiber> fibers;  // MAX_THREADS; never reallocated (contexts point into it)
  std::vector<Warp> warps;
  std::vector<unsigned> order, lanes;
  std::vector<Region> buffers;
  uint64_t blocks_run = 0;
  void* scheduler_sp = nullptr;
  ucontext_t scheduler;
  // The running launch and block.
  bool in_launch = false;
  const char* kernel = "";
  unsigned threads = 0, running = 0, block_arrived = 0, exited = 0;
  bool faulted = false;
  char message[1024];
  void (*call)(void*) = nullptr;
  void* call_ctx = nullptr;
};
Runtime rt;

[[noreturn]] void die(const char* what) {
  std::fflush(stdout);
  std::fprintf(stderr, "emulation runtime: %s\n", what);
  std::_Exit(2);
}

uint64_t next_random() {  // splitmix64
  uint64_t z = (rt.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void shuffled(std::vector<unsigned>& v, unsigned n) {
  v.resize(n);
  for (unsigned i = 0; i < n; ++i) v[i] = i;
  for (unsigned i = n; i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

bool shadow_stack_active() {
#if defined(__x86_64__)
  uint64_t ssp = 0;
  // rdsspq %rax: leaves 0 unless shadow stacks are enabled (a NOP on CPUs without CET).
  __asm__ volatile(".byte 0xf3, 0x48, 0x0f, 0x1e, 0xc8" : "+a"(ssp));
  return ssp != 0;
#else
  return false;
#endif
}

void init() {
  if (rt.initialised) return;
  rt.initialised = true;
  rt.rng = seed();
#ifdef EMU_REGISTER_SWITCH
  rt.registers = !shadow_stack_active() && std::getenv("EMU_UCONTEXT") == nullptr;
#endif
  rt.fibers.resize(MAX_THREADS);
  rt.warps.resize(MAX_THREADS / 32);
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (STACK_BYTES % page != 0) die("fiber stack size is not a multiple of the page size");
  void* p = mmap(nullptr, MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("cannot map the fiber stacks");
  rt.stacks = static_cast<char*>(p);
  for (unsigned t = 0; t < MAX_THREADS; ++t)  // a stack overflow faults instead of corrupting
    if (mprotect(rt.stacks + t * STACK_BYTES, page, PROT_NONE) != 0) die("mprotect failed");
}

// Resumes thread t from the scheduler, until it waits or exits.
void resume(unsigned t) {
  rt.running = t;
  threadIdx = dim3{t, 0, 0};
#ifdef EMU_REGISTER_SWITCH
  if (rt.registers) {
    emu_switch(&rt.scheduler_sp, rt.fibers[t].sp);
    return;
  }
#endif
  if (swapcontext(&rt.scheduler, &rt.fibers[t].ctx) != 0) die("swapcontext failed");
}

// Switches from the running thread back to the scheduler, which resumes it once its state is
// Ready again (never after a fault or an exit).
void suspend(State state) {
  Fiber& me = rt.fibers[rt.running];
  me.state = state;
#ifdef EMU_REGISTER_SWITCH
  if (rt.registers) {
    emu_switch(&me.sp, rt.scheduler_sp);
    return;
  }
#endif
  if (swapcontext(&me.ctx, &rt.scheduler) != 0) die("swapcontext failed");
}

void fiber_main() {
  rt.call(rt.call_ctx);
  if (rt.block_arrived != 0)
    fault("thread exited while %u threads wait at __syncthreads()", rt.block_arrived);
  if (rt.warps[rt.running / 32].arrived != 0)
    fault("thread exited while lanes of its warp wait in a shuffle");
  ++rt.exited;
  suspend(State::Exited);
  die("an exited thread was resumed");
}

// Makes thread t a fresh fiber that will run the launch's body.
void start_fiber(unsigned t) {
  Fiber& f = rt.fibers[t];
  f.state = State::Ready;
  char* top = rt.stacks + (t + 1) * STACK_BYTES;  // 16-byte aligned
#ifdef EMU_REGISTER_SWITCH
  if (rt.registers) {
    void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
    // emu_switch pops r15, r14, r13, r12, rbx, rbp (zeros), then returns into fiber_main with
    // the stack as after a call (rsp = 8 mod 16; the fake return address is 0).
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&fiber_main);
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
#else
    // emu_switch loads x19..x28, x29 = 0, x30 = fiber_main, d8..d15 from a 160-byte frame, pops
    // it (sp = top, 16-byte aligned) and returns to x30.
    sp -= 20;
    for (int i = 0; i < 20; ++i) sp[i] = nullptr;
    sp[11] = reinterpret_cast<void*>(&fiber_main);
#endif
    f.sp = sp;
    return;
  }
#endif
  if (getcontext(&f.ctx) != 0) die("getcontext failed");
  f.ctx.uc_stack.ss_sp = rt.stacks + t * STACK_BYTES;
  f.ctx.uc_stack.ss_size = STACK_BYTES;
  f.ctx.uc_link = nullptr;  // fiber_main never returns
  makecontext(&f.ctx, fiber_main, 0);
}

std::string describe_waits() {
  unsigned counts[4] = {0, 0, 0, 0};
  for (unsigned t = 0; t < rt.threads; ++t) ++counts[(int)rt.fibers[t].state];
  char buf[160];
  std::snprintf(buf, sizeof buf, "%u threads at __syncthreads(), %u in a shuffle, %u exited",
                counts[(int)State::AtSyncthreads], counts[(int)State::AtShuffle],
                counts[(int)State::Exited]);
  return buf;
}

bool all_bytes(const unsigned char* p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return false;
  return true;
}

// One scheduling step of the block; false if no thread could run. Two policies, alternating
// from block to block:
//  - round robin: every runnable thread runs to its next barrier, in a fresh shuffled order each
//    round (fine-grained interleavings);
//  - warp priority: the warps get a random priority; the highest-priority warp with a runnable
//    lane runs (its lanes in shuffled order) until it waits at __syncthreads() or exits, so one
//    warp runs as far ahead of the others as the barriers allow (catches a missing barrier
//    between two phases that only a slow warp would notice).
bool step(bool by_warp, bool& faulted) {
  bool ran = false;
  if (!by_warp) {
    shuffled(rt.order, rt.threads);
    for (unsigned t : rt.order) {
      if (rt.fibers[t].state != State::Ready) continue;
      resume(t);
      ran = true;
      if ((faulted = rt.faulted)) return true;
    }
    return ran;
  }
  for (unsigned w : rt.order) {  // warps, highest priority first
    const unsigned n = std::min(32u, rt.threads - 32 * w);
    shuffled(rt.lanes, n);
    for (unsigned l : rt.lanes) {
      const unsigned t = 32 * w + l;
      if (rt.fibers[t].state != State::Ready) continue;
      resume(t);
      ran = true;
      if ((faulted = rt.faulted)) return true;
    }
    if (ran) return true;
  }
  return false;
}

// Runs block bx to completion; false (rt.message set) on a fault. `region` is the dynamic shared
// memory with its guards, refilled with 0xff first.
bool run_block(unsigned bx, unsigned char* region, size_t region_bytes) {
  blockIdx = dim3{bx, 0, 0};
  rt.block_arrived = rt.exited = 0;
  const unsigned warps = (rt.threads + 31) / 32;
  for (unsigned w = 0; w < warps; ++w) rt.warps[w].arrived = rt.warps[w].parity = 0;
  std::memset(region, 0xff, region_bytes);
  for (unsigned t = 0; t < rt.threads; ++t) start_fiber(t);
  const bool by_warp = (rt.blocks_run++ & 1) != 0;
  if (by_warp) shuffled(rt.order, warps);  // the warps' priorities
  while (rt.exited < rt.threads) {
    bool faulted = false;
    const bool ran = step(by_warp, faulted);
    if (faulted) return false;
    if (!ran) {
      std::snprintf(rt.message, sizeof rt.message, "%s: block %u: deadlock: %s", rt.kernel, bx,
                    describe_waits().c_str());
      return false;
    }
  }
  if (!all_bytes(region, GUARD_BYTES + 16, 0xff) ||
      !all_bytes(region + region_bytes - GUARD_BYTES, GUARD_BYTES, 0xff)) {
    std::snprintf(rt.message, sizeof rt.message,
                  "%s: block %u wrote outside its %u bytes of dynamic shared memory", rt.kernel,
                  bx, dyn_smem_size);
    return false;
  }
  return true;
}

}  // namespace

uint64_t seed() {
  const char* s = std::getenv("EMU_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 0) : 1;
}

const char* switch_kind() {
  init();
  return rt.registers ? "registers" : "ucontext";
}

[[noreturn]] void fault(const char* fmt, ...) {
  char what[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  if (!rt.in_launch) die(what);
  std::snprintf(rt.message, sizeof rt.message, "%s: block %u, thread %u: %s", rt.kernel,
                blockIdx.x, rt.running, what);
  rt.faulted = true;
  suspend(State::Exited);
  die("a faulted thread was resumed");
}

void sync_block() {
  if (rt.exited != 0) fault("__syncthreads() after %u threads of the block exited", rt.exited);
  if (++rt.block_arrived == rt.threads) {
    rt.block_arrived = 0;
    for (unsigned t = 0; t < rt.threads; ++t)
      if (rt.fibers[t].state == State::AtSyncthreads) rt.fibers[t].state = State::Ready;
    suspend(State::Ready);  // the last to arrive waits for its turn too
  } else {
    suspend(State::AtSyncthreads);
  }
}

uint64_t shfl_exchange(uint64_t bits, int lane_mask, unsigned size) {
  const unsigned t = rt.running, lane = t & 31, base = t & ~31u;
  if (base + 32 > rt.threads) fault("warp shuffle in a partial warp (blockDim.x = %u)", rt.threads);
  if (lane_mask < 0 || lane_mask > 31) fault("shuffle lane mask %d", lane_mask);
  Warp& w = rt.warps[t / 32];
  const unsigned p = w.parity;
  w.value[p][lane] = bits;
  w.offset[p][lane] = lane_mask;
  w.size[p][lane] = size;
  if (++w.arrived == 32) {
    for (unsigned l = 0; l < 32; ++l)
      if (w.offset[p][l] != lane_mask || w.size[p][l] != size)
        fault("divergent warp shuffle: lane %u xor %d (%u bytes), lane %u xor %d (%u bytes)", l,
              w.offset[p][l], w.size[p][l], lane, lane_mask, size);
    w.arrived = 0;
    w.parity ^= 1;
    for (unsigned l = 0; l < 32; ++l)
      if (rt.fibers[base + l].state == State::AtShuffle) rt.fibers[base + l].state = State::Ready;
    suspend(State::Ready);
  } else {
    suspend(State::AtShuffle);
  }
  return w.value[p][lane ^ (unsigned)lane_mask];
}

void track_buffer(unsigned char* base, size_t bytes, const char* name) {
  rt.buffers.push_back(Region{base, bytes, name});
}

void untrack_buffer(unsigned char* base) {
  for (size_t i = 0; i < rt.buffers.size(); ++i)
    if (rt.buffers[i].base == base) {
      rt.buffers.erase(rt.buffers.begin() + (long)i);
      return;
    }
}

Launch launch_impl(const char* kernel, unsigned grid, unsigned block, unsigned smem,
                   void (*call)(void*), void* ctx) {
  init();
  if (grid == 0 || block == 0 || block > MAX_THREADS)
    return Launch{false, std::string(kernel) + ": invalid launch configuration"};
  if (smem > MAX_DYN_SMEM)
    return Launch{false, std::string(kernel) + ": " + std::to_string(smem) +
                             " bytes of dynamic shared memory exceed the 48 KiB default limit"};
  // Region: guard | 16 bytes (so that the base is 16 mod 32) | smem | guard.
  std::vector<unsigned char> mem(2 * GUARD_BYTES + smem + 64);
  unsigned char* region = mem.data() + (32 - (uintptr_t)mem.data() % 32) % 32;
  const size_t region_bytes = GUARD_BYTES + 16 + smem + GUARD_BYTES;
  dyn_smem = region + GUARD_BYTES + 16;
  dyn_smem_size = smem;
  gridDim = dim3{grid, 1, 1};
  blockDim = dim3{block, 1, 1};
  rt.kernel = kernel;
  rt.threads = block;
  rt.faulted = false;
  rt.call = call;
  rt.call_ctx = ctx;
  rt.in_launch = true;
  std::vector<unsigned> order;
  shuffled(order, grid);
  Launch result{true, ""};
  for (unsigned bx : order)
    if (!run_block(bx, region, region_bytes)) {
      result = Launch{false, rt.message};
      break;
    }
  rt.in_launch = false;
  dyn_smem = nullptr;
  dyn_smem_size = 0;
  if (result.ok)
    for (const Region& r : rt.buffers)
      if (!all_bytes(r.base, GUARD_BYTES, 0xff) ||
          !all_bytes(r.base + GUARD_BYTES + r.bytes, GUARD_BYTES, 0xff)) {
        result = Launch{false, std::string(kernel) + " wrote outside `" + r.name + "`"};
        break;
      }
  return result;
}

}  // namespace emu
