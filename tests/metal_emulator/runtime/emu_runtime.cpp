// Metal emulator runtime: deterministic cooperative scheduling of one threadgroup's lanes (fibers),
// SIMD-group exchanges, threadgroup barriers, guarded device buffers and fault reporting.
// Built once into a shared library that the Python runner loads with RTLD_GLOBAL; every kernel
// library resolves the emu_* symbols against it.
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "emu_abi.h"

// ---- fibers: a minimal stack switch on x86-64 (swapcontext costs two syscalls), ucontext elsewhere ----
#if defined(__x86_64__) && !defined(EMU_USE_UCONTEXT)
extern "C" void emu_ctx_switch(void** save_sp, void* new_sp);
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the
// stack pointer in *save_sp, switches to new_sp and restores the same from there.
asm(R"(
  .text
  .globl emu_ctx_switch
  .hidden emu_ctx_switch
  .type emu_ctx_switch, @function
emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_ctx_switch, .-emu_ctx_switch
)");

struct FiberCtx {
  void* sp;
};

void fiber_init(FiberCtx& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  uintptr_t top = ((uintptr_t)(stack + bytes)) & ~(uintptr_t)15;
  uint64_t* p = (uint64_t*)top;
  *--p = 0;                  // fake return address of entry (keeps the ABI stack alignment)
  *--p = (uint64_t)entry;    // popped by `ret`
  for (int i = 0; i < 6; ++i) *--p = 0;  // rbp rbx r12 r13 r14 r15
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  *--p = (uint64_t)csr[0] | ((uint64_t)(csr[1] & 0xFFFF) << 32);
  c.sp = p;
}

inline void fiber_swap(FiberCtx& from, FiberCtx& to) { emu_ctx_switch(&from.sp, to.sp); }
#else
struct FiberCtx {
  ucontext_t uc;
};

void fiber_init(FiberCtx& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

inline void fiber_swap(FiberCtx& from, FiberCtx& to) { swapcontext(&from.uc, &to.uc); }
#endif

namespace {

constexpr size_t kStackBytes = 256 * 1024;

enum LaneState { kReady, kAtBarrier, kAtSimd, kDone };

struct Lane {
  FiberCtx ctx;
  LaneState state;
  unsigned op, site;
  unsigned exchanges;  // SIMD exchanges completed by this lane (parity selects the slot bank)
  emu_thread_attrs attrs;
};

struct SimdGroup {
  unsigned char slots[2][EMU_SIMD_WIDTH][EMU_SLOT_BYTES];
  uint32_t active[2];
  uint32_t present;  // lanes that exist in this SIMD-group
};

struct TgVar {
  const char* name;
  const unsigned char* pre;
  size_t pre_bytes;
  const unsigned char* post;
  size_t post_bytes;
  size_t data_bytes;
};

struct Buffer {
  unsigned char* map;  // whole mapping: [guard page][pre slack][data][tail slack][guard page]
  size_t map_bytes;
  unsigned char* data;
  size_t nbytes;
  size_t itemsize;
  std::string name;
  bool readonly;
};

struct Run {
  emu_lane_fn fn = nullptr;
  void* const* args = nullptr;
  std::vector<Lane> lanes;
  std::vector<SimdGroup> sgs;
  std::vector<int> order;
  int current = -1;
  bool exited_ok = false;
  FiberCtx main_ctx;
  sigjmp_buf jmp;
  bool failed = false;
  std::string check, detail;
  std::vector<TgVar> tg_vars;
};

Run* g_run = nullptr;
uint64_t g_generation = 0;
std::vector<Buffer> g_buffers;

unsigned char* g_stacks = nullptr;
size_t g_stack_count = 0;
size_t g_page = 0;

size_t page_size() {
  if (!g_page) g_page = (size_t)sysconf(_SC_PAGESIZE);
  return g_page;
}

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string lane_name(const Lane& l) {
  const emu_thread_attrs& a = l.attrs;
  return fmt("thread_position_in_grid=(%u,%u,%u) threadgroup=(%u,%u,%u) lane %u of simdgroup %u",
             a.thread_position_in_grid[0], a.thread_position_in_grid[1], a.thread_position_in_grid[2],
             a.threadgroup_position_in_grid[0], a.threadgroup_position_in_grid[1],
             a.threadgroup_position_in_grid[2], a.thread_index_in_simdgroup,
             a.simdgroup_index_in_threadgroup);
}

void set_failure(Run& r, const std::string& check, const std::string& detail) {
  if (r.failed) return;
  r.failed = true;
  r.check = check;
  r.detail = detail;
}

void fill_poison(unsigned char* p, size_t n, uintptr_t phase) {
  for (size_t i = 0; i < n; ++i)
    p[i] = ((phase + i) & 1) ? EMU_POISON_BYTE1 : EMU_POISON_BYTE0;
}

// Index of the first byte in [p, p+n) that is not the poison pattern, or -1.
long long first_damaged(const unsigned char* p, size_t n, uintptr_t phase) {
  for (size_t i = 0; i < n; ++i) {
    unsigned char want = ((phase + i) & 1) ? EMU_POISON_BYTE1 : EMU_POISON_BYTE0;
    if (p[i] != want) return (long long)i;
  }
  return -1;
}

void ensure_stacks(size_t count) {
  if (count <= g_stack_count) return;
  size_t per = kStackBytes + page_size();
  if (g_stacks) munmap(g_stacks, g_stack_count * per);
  void* m = mmap(nullptr, count * per, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) {
    g_stacks = nullptr;
    g_stack_count = 0;
    return;
  }
  g_stacks = (unsigned char*)m;
  g_stack_count = count;
  for (size_t i = 0; i < count; ++i) mprotect(g_stacks + i * per, page_size(), PROT_NONE);  // guard page
}

unsigned char* stack_of(size_t i) { return g_stacks + i * (kStackBytes + page_size()) + page_size(); }

void lane_entry() {
  Run& r = *g_run;
  Lane& l = r.lanes[r.current];
  r.fn(r.args, &l.attrs);
  l.state = kDone;
  fiber_swap(l.ctx, r.main_ctx);  // never resumed
  __builtin_trap();
}

// Yield from the current lane to the scheduler.
void yield_lane() {
  Run& r = *g_run;
  fiber_swap(r.lanes[r.current].ctx, r.main_ctx);
}

void check_tg_canaries(Run& r) {
  for (const TgVar& v : r.tg_vars) {
    long long a = first_damaged(v.pre, v.pre_bytes, 0);
    long long b = first_damaged(v.post, v.post_bytes, 0);
    if (a >= 0 || b >= 0) {
      std::string where = a >= 0 ? fmt("%lld bytes before its start", (long long)v.pre_bytes - a)
                                 : fmt("at byte offset %lld (size %zu bytes)",
                                       (long long)v.data_bytes + b, v.data_bytes);
      set_failure(r, "threadgroup_oob",
                  fmt("out-of-bounds write to threadgroup variable '%s' %s", v.name, where.c_str()));
      return;
    }
  }
}

const char* op_name(unsigned op) {
  static const char* names[] = {"?", "simd_sum", "simd_product", "simd_min", "simd_max", "simd_and",
                                "simd_or", "simd_xor", "simd_shuffle", "simd_shuffle_xor",
                                "simd_shuffle_down", "simd_shuffle_up", "simd_shuffle_rotate_down",
                                "simd_shuffle_rotate_up", "simd_broadcast", "simd_broadcast_first",
                                "simd_prefix_exclusive_sum", "simd_prefix_inclusive_sum",
                                "simd_prefix_exclusive_product", "simd_prefix_inclusive_product",
                                "simd_all", "simd_any", "simd_ballot", "simd_is_first",
                                "simdgroup_barrier", "simd_active_threads_mask", "simdgroup_load",
                                "simdgroup_store", "simdgroup_multiply_accumulate", "simdgroup_multiply"};
  return op < sizeof(names) / sizeof(names[0]) ? names[op] : "?";
}


// Resolve blocked lanes after every lane ran to a sync point. Returns false when all are done.
bool resolve(Run& r) {
  bool progressed = false;
  const int n = (int)r.lanes.size();
  for (size_t g = 0; g < r.sgs.size() && !r.failed; ++g) {
    SimdGroup& sg = r.sgs[g];
    int first_wait = -1, barrier_lane = -1, done_lane = -1;
    for (int ln = 0; ln < EMU_SIMD_WIDTH; ++ln) {
      if (!(sg.present & (1u << ln))) continue;
      int i = (int)g * EMU_SIMD_WIDTH + ln;
      const Lane& l = r.lanes[i];
      if (l.state == kAtSimd) {
        if (first_wait < 0) first_wait = i;
      } else if (l.state == kAtBarrier) {
        if (barrier_lane < 0) barrier_lane = i;
      } else if (l.state == kDone) {
        if (done_lane < 0) done_lane = i;
      }
    }
    if (first_wait < 0) continue;
    const Lane& w = r.lanes[first_wait];
    if (barrier_lane >= 0) {
      set_failure(r, "simd_divergence",
                  fmt("%s called at line %u by some lanes of simdgroup %zu while %s waits at a "
                      "threadgroup barrier (line %u): SIMD-group functions need SIMD-uniform control flow",
                      op_name(w.op), w.site, g, lane_name(r.lanes[barrier_lane]).c_str(),
                      r.lanes[barrier_lane].site));
      return true;
    }
    if (done_lane >= 0 && !r.exited_ok) {
      set_failure(r, "simd_divergence",
                  fmt("%s called at line %u while %s already returned: SIMD-group functions need "
                      "every lane of the SIMD-group (an early return before a SIMD function is a bug "
                      "on CUDA and in the shared dialect)",
                      op_name(w.op), w.site, lane_name(r.lanes[done_lane]).c_str()));
      return true;
    }
    uint32_t active = 0;
    unsigned parity = w.exchanges & 1;
    for (int ln = 0; ln < EMU_SIMD_WIDTH; ++ln) {
      if (!(sg.present & (1u << ln))) continue;
      Lane& l = r.lanes[(int)g * EMU_SIMD_WIDTH + ln];
      if (l.state != kAtSimd) continue;
      if (l.op != w.op || l.site != w.site) {
        set_failure(r, "simd_divergence",
                    fmt("lanes of simdgroup %zu disagree: %s at line %u vs %s at line %u (%s)", g,
                        op_name(w.op), w.site, op_name(l.op), l.site, lane_name(l).c_str()));
        return true;
      }
      active |= 1u << ln;
    }
    sg.active[parity] = active;
    for (int ln = 0; ln < EMU_SIMD_WIDTH; ++ln) {
      if (!(active & (1u << ln))) continue;
      Lane& l = r.lanes[(int)g * EMU_SIMD_WIDTH + ln];
      l.state = kReady;
      l.exchanges++;
    }
    progressed = true;
  }
  if (r.failed || progressed) return true;
  int at_barrier = -1, done = -1;
  for (int i = 0; i < n; ++i) {
    if (r.lanes[i].state == kAtBarrier && at_barrier < 0) at_barrier = i;
    if (r.lanes[i].state == kDone && done < 0) done = i;
  }
  if (at_barrier < 0) return false;  // every lane returned
  if (done >= 0) {
    set_failure(r, "barrier_divergence",
                fmt("threadgroup_barrier at line %u is waited on by %s but %s already returned: every "
                    "thread of a threadgroup must reach each barrier",
                    r.lanes[at_barrier].site, lane_name(r.lanes[at_barrier]).c_str(),
                    lane_name(r.lanes[done]).c_str()));
    return true;
  }
  unsigned site = r.lanes[at_barrier].site;
  for (int i = 0; i < n; ++i) {
    if (r.lanes[i].site != site) {
      set_failure(r, "barrier_divergence",
                  fmt("lanes wait at different threadgroup barriers (line %u: %s; line %u: %s)", site,
                      lane_name(r.lanes[at_barrier]).c_str(), r.lanes[i].site,
                      lane_name(r.lanes[i]).c_str()));
      return true;
    }
  }
  check_tg_canaries(r);
  for (int i = 0; i < n; ++i) r.lanes[i].state = kReady;
  return true;
}

void run_threadgroup(Run& r) {
  const int n = (int)r.lanes.size();
  r.tg_vars.clear();
  ++g_generation;
  for (int i = 0; i < n; ++i) {
    Lane& l = r.lanes[i];
    fiber_init(l.ctx, stack_of(i), kStackBytes, lane_entry);
    l.state = kReady;
    l.op = l.site = 0;
    l.exchanges = 0;
  }
  for (;;) {
    for (int i : r.order) {
      if (r.lanes[i].state != kReady) continue;
      r.current = i;
      fiber_swap(r.main_ctx, r.lanes[i].ctx);
      r.current = -1;
      if (r.failed) return;
    }
    if (!resolve(r)) break;
    if (r.failed) return;
  }
  check_tg_canaries(r);
}

// ---- signals: out-of-bounds device access, array-bounds traps, stack overflow ----

volatile sig_atomic_t g_sig = 0;
volatile sig_atomic_t g_sig_code = 0;
void* volatile g_sig_addr = nullptr;
int g_sig_lane = -1;

void on_signal(int sig, siginfo_t* si, void*) {
  g_sig = sig;
  g_sig_code = si->si_code;
  g_sig_addr = si->si_addr;
  g_sig_lane = g_run ? g_run->current : -1;
  siglongjmp(g_run->jmp, 1);
}

std::string describe_address(uintptr_t a) {
  for (const Buffer& b : g_buffers) {
    uintptr_t lo = (uintptr_t)b.map, hi = lo + b.map_bytes;
    if (a < lo || a >= hi) continue;
    uintptr_t d0 = (uintptr_t)b.data, d1 = d0 + b.nbytes;
    long long off = (long long)(a - d0);
    if (a >= d0 && a < d1)
      return fmt("write to read-only input buffer '%s' at byte offset %lld (element %lld)", b.name.c_str(),
                 off, off / (long long)b.itemsize);
    const char* side = a < d0 ? "before the start" : "past the end";
    return fmt("access %s of buffer '%s' at byte offset %lld (element %lld; buffer has %zu elements)",
               side, b.name.c_str(), off, off < 0 ? -((-off + (long long)b.itemsize - 1) / (long long)b.itemsize) : off / (long long)b.itemsize,
               b.nbytes / b.itemsize);
  }
  if (g_stacks) {
    size_t per = kStackBytes + page_size();
    uintptr_t s0 = (uintptr_t)g_stacks;
    if (a >= s0 && a < s0 + g_stack_count * per && (a - s0) % per < page_size())
      return fmt("stack overflow of a lane (more than %zu KiB of thread memory)", kStackBytes / 1024);
  }
  return fmt("invalid address %p", (void*)a);
}

struct SignalGuard {
  static constexpr int kSignals[4] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  struct sigaction old[4];
  stack_t old_stack;
  std::vector<unsigned char> alt;
  SignalGuard() : alt(1 << 16) {
    stack_t ss;
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    ss.ss_flags = 0;
    sigaltstack(&ss, &old_stack);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &sa, &old[i]);
  }
  ~SignalGuard() {
    for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &old[i], nullptr);
    sigaltstack(&old_stack, nullptr);
  }
};
constexpr int SignalGuard::kSignals[4];

// CPU-time limit for one run: a timer on this thread's CPU clock raising SIGVTALRM in this thread
// (lanes are never preempted, so an endless loop or a spin-wait on another lane would hang).
struct CpuTimer {
  timer_t id;
  bool created = false;
  struct sigaction old;
  explicit CpuTimer(double seconds) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGVTALRM, &sa, &old);
    if (seconds <= 0) return;
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = SIGVTALRM;
    sev._sigev_un._tid = (pid_t)gettid();
    created = timer_create(CLOCK_THREAD_CPUTIME_ID, &sev, &id) == 0;
    limit = seconds;
  }
  void arm() {
    if (!created) return;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_sec = (time_t)limit;
    its.it_value.tv_nsec = (long)((limit - (double)(time_t)limit) * 1e9);
    timer_settime(id, 0, &its, nullptr);
  }
  ~CpuTimer() {
    if (created) timer_delete(id);
    sigaction(SIGVTALRM, &old, nullptr);
  }
  double limit = 0;
};

}  // namespace

extern "C" {

void emu_threadgroup_barrier(unsigned site) {
  Run& r = *g_run;
  Lane& l = r.lanes[r.current];
  l.state = kAtBarrier;
  l.site = site;
  yield_lane();
}

const unsigned char* emu_simd_exchange(unsigned op, unsigned site, const void* value, unsigned size,
                                       uint32_t* active, unsigned* lane) {
  Run& r = *g_run;
  Lane& l = r.lanes[r.current];
  if (size > EMU_SLOT_BYTES) emu_fail("unsupported", "SIMD-group value larger than 64 bytes");
  unsigned g = l.attrs.simdgroup_index_in_threadgroup, ln = l.attrs.thread_index_in_simdgroup;
  unsigned parity = l.exchanges & 1;
  SimdGroup& sg = r.sgs[g];
  memset(sg.slots[parity][ln], 0, EMU_SLOT_BYTES);
  if (size) memcpy(sg.slots[parity][ln], value, size);
  l.state = kAtSimd;
  l.op = op;
  l.site = site;
  yield_lane();
  *active = sg.active[parity];
  *lane = ln;
  return &sg.slots[parity][0][0];
}

void emu_fail(const char* check, const char* detail) {
  Run& r = *g_run;
  std::string where = r.current >= 0 ? " [" + lane_name(r.lanes[r.current]) + "]" : "";
  set_failure(r, check, std::string(detail) + where);
  if (r.current >= 0) {
    fiber_swap(r.lanes[r.current].ctx, r.main_ctx);
  }
  siglongjmp(r.jmp, 2);
}

// ---- UndefinedBehaviorSanitizer handlers (GCC's libubsan ABI): kernels are compiled with
// -fsanitize=bounds,alignment,shift-exponent,integer-divide-by-zero and linked against these. ----
struct UbsanLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanType {
  uint16_t kind, info;
  char name[1];
};
struct UbsanOutOfBounds {
  UbsanLocation loc;
  const UbsanType* array_type;
  const UbsanType* index_type;
};
struct UbsanTypeMismatch {
  UbsanLocation loc;
  const UbsanType* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};
struct UbsanBinary {
  UbsanLocation loc;
  const UbsanType* lhs_type;
  const UbsanType* rhs_type;
};

static std::string ubsan_int(const UbsanType* t, uintptr_t v) {
  unsigned bits = 1u << (t->info >> 1);
  if (t->kind == 0 && (t->info & 1) && bits < 64) {  // signed integer: sign-extend
    uint64_t m = 1ull << (bits - 1);
    int64_t s = (int64_t)(((uint64_t)v & ((m << 1) - 1)) ^ m) - (int64_t)m;
    return fmt("%lld", (long long)s);
  }
  if (t->kind == 0 && (t->info & 1)) return fmt("%lld", (long long)v);
  return fmt("%llu", (unsigned long long)v);
}

static std::string ubsan_where(const UbsanLocation& l) { return fmt("%s:%u:%u", l.file, l.line, l.column); }

void __ubsan_handle_out_of_bounds(UbsanOutOfBounds* d, uintptr_t index) {
  emu_fail("array_bounds", fmt("index %s is outside the array of type %s at %s",
                               ubsan_int(d->index_type, index).c_str(), d->array_type->name,
                               ubsan_where(d->loc).c_str()).c_str());
}
void __ubsan_handle_out_of_bounds_abort(UbsanOutOfBounds* d, uintptr_t index) {
  __ubsan_handle_out_of_bounds(d, index);
}

void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* d, uintptr_t ptr) {
  static const char* kinds[] = {"load of", "store to", "reference binding to", "member access within",
                                "member call on", "constructor call on", "downcast of", "downcast of",
                                "upcast of", "cast to virtual base of", "nonnull binding to",
                                "dynamic operation on"};
  const char* kind = d->check_kind < sizeof(kinds) / sizeof(kinds[0]) ? kinds[d->check_kind] : "access to";
  uintptr_t align = (uintptr_t)1 << d->log_alignment;
  if (ptr == 0)
    emu_fail("null_pointer", fmt("%s a null pointer of type '%s' at %s", kind, d->type->name,
                                 ubsan_where(d->loc).c_str()).c_str());
  if (ptr & (align - 1))
    emu_fail("misaligned_access",
             fmt("%s address %p, which is not aligned to %zu bytes as type %s requires, at %s", kind,
                 (void*)ptr, (size_t)align, d->type->name, ubsan_where(d->loc).c_str()).c_str());
  emu_fail("invalid_access", fmt("%s address %p with insufficient space for type %s at %s", kind,
                                 (void*)ptr, d->type->name, ubsan_where(d->loc).c_str()).c_str());
}
void __ubsan_handle_type_mismatch_v1_abort(UbsanTypeMismatch* d, uintptr_t ptr) {
  __ubsan_handle_type_mismatch_v1(d, ptr);
}

void __ubsan_handle_shift_out_of_bounds(UbsanBinary* d, uintptr_t lhs, uintptr_t rhs) {
  (void)lhs;
  emu_fail("shift_out_of_range", fmt("shift by %s bits of a %s value at %s (undefined, as in Metal)",
                                     ubsan_int(d->rhs_type, rhs).c_str(), d->lhs_type->name,
                                     ubsan_where(d->loc).c_str()).c_str());
}
void __ubsan_handle_shift_out_of_bounds_abort(UbsanBinary* d, uintptr_t lhs, uintptr_t rhs) {
  __ubsan_handle_shift_out_of_bounds(d, lhs, rhs);
}

struct UbsanOverflow {
  UbsanLocation loc;
  const UbsanType* type;
};
void __ubsan_handle_divrem_overflow(UbsanOverflow* d, uintptr_t lhs, uintptr_t rhs) {
  (void)lhs;
  (void)rhs;
  emu_fail("integer_division", fmt("integer division by zero (or INT_MIN / -1) of type %s at %s",
                                   d->type->name, ubsan_where(d->loc).c_str()).c_str());
}
void __ubsan_handle_divrem_overflow_abort(UbsanOverflow* d, uintptr_t lhs, uintptr_t rhs) {
  __ubsan_handle_divrem_overflow(d, lhs, rhs);
}

uint64_t emu_tg_generation(void) { return g_generation; }

const emu_thread_attrs* emu_current_attrs(void) {
  Run& r = *g_run;
  if (r.current < 0) emu_fail("internal", "emu_current_attrs called outside a lane");
  return &r.lanes[r.current].attrs;
}

void emu_tg_register(const char* name, const unsigned char* pre, size_t pre_bytes, const unsigned char* post,
                     size_t post_bytes, size_t data_bytes) {
  Run& r = *g_run;
  r.tg_vars.push_back(TgVar{name, pre, pre_bytes, post, post_bytes, data_bytes});
  size_t total = 0;
  for (const TgVar& v : r.tg_vars) total += v.data_bytes;
  if (total > EMU_THREADGROUP_MEMORY_BYTES)
    emu_fail("threadgroup_memory_limit",
             fmt("threadgroup variables need %zu bytes, Metal allows %d", total,
                 EMU_THREADGROUP_MEMORY_BYTES).c_str());
}

void* emu_buffer_new(size_t nbytes, const char* name, size_t itemsize) {
  size_t pg = page_size();
  size_t body = (nbytes + 15) & ~(size_t)15;   // data start stays 16-byte aligned
  size_t slack_pages = (body + 64 + pg - 1) / pg;  // >= 64 poison bytes before the data
  size_t map_bytes = (slack_pages + 2) * pg;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  unsigned char* map = (unsigned char*)m;
  mprotect(map, pg, PROT_NONE);
  mprotect(map + map_bytes - pg, pg, PROT_NONE);
  unsigned char* end = map + map_bytes - pg;
  unsigned char* data = end - body;
  fill_poison(map + pg, (size_t)(end - (map + pg)), 0);
  g_buffers.push_back(Buffer{map, map_bytes, data, nbytes, itemsize ? itemsize : 1, name ? name : "?", false});
  return data;
}

void emu_buffer_protect_readonly(void* data) {
  for (Buffer& b : g_buffers) {
    if (b.data != data) continue;
    size_t pg = page_size();
    mprotect(b.map + pg, b.map_bytes - 2 * pg, PROT_READ);
    b.readonly = true;
  }
}

int emu_buffer_check(void* data, long long* offset) {
  for (Buffer& b : g_buffers) {
    if (b.data != data) continue;
    size_t pg = page_size();
    unsigned char* start = b.map + pg;
    long long pre = first_damaged(start, (size_t)(b.data - start), 0);
    if (pre >= 0) {
      *offset = (long long)(start + pre - b.data);  // negative: before the data
      return 1;
    }
    unsigned char* tail = b.data + b.nbytes;
    unsigned char* end = b.map + b.map_bytes - pg;
    long long post = first_damaged(tail, (size_t)(end - tail), (uintptr_t)(tail - start));
    if (post >= 0) {
      *offset = (long long)b.nbytes + post;
      return 1;
    }
    return 0;
  }
  return 0;
}

void emu_buffer_free(void* data) {
  for (size_t i = 0; i < g_buffers.size(); ++i) {
    if (g_buffers[i].data != data) continue;
    munmap(g_buffers[i].map, g_buffers[i].map_bytes);
    g_buffers.erase(g_buffers.begin() + (long)i);
    return;
  }
}

int emu_run(emu_lane_fn fn, void* const* args, const uint32_t grid[3], const uint32_t threadgroup[3],
            int reverse, int exited_lanes_in_simd_ok, double cpu_seconds, char* err, size_t errlen) {
  Run r;
  r.fn = fn;
  r.args = args;
  r.exited_ok = exited_lanes_in_simd_ok != 0;
  uint32_t tg[3], ngroups[3];
  for (int d = 0; d < 3; ++d) {
    if (grid[d] == 0 || threadgroup[d] == 0) {
      snprintf(err, errlen, "launch\tgrid and threadgroup dimensions must be positive");
      return 1;
    }
    tg[d] = std::min(threadgroup[d], grid[d]);  // MLX clamps the threadgroup to the grid
    ngroups[d] = (grid[d] + tg[d] - 1) / tg[d];
  }
  uint64_t tg_size = (uint64_t)tg[0] * tg[1] * tg[2];
  if (tg_size > EMU_MAX_THREADS_PER_THREADGROUP) {
    snprintf(err, errlen, "threadgroup_size\tthreadgroup of %llu threads exceeds %d",
             (unsigned long long)tg_size, EMU_MAX_THREADS_PER_THREADGROUP);
    return 1;
  }
  ensure_stacks((size_t)tg_size);
  if (!g_stacks) {
    snprintf(err, errlen, "launch\tcannot allocate lane stacks");
    return 1;
  }
  std::vector<uint32_t> groups;
  uint64_t total_groups = (uint64_t)ngroups[0] * ngroups[1] * ngroups[2];
  g_run = &r;
  g_sig = 0;
  SignalGuard guard;
  CpuTimer timer(cpu_seconds);
  if (sigsetjmp(r.jmp, 1) == 0) {
    timer.arm();
    for (uint64_t k = 0; k < total_groups && !r.failed; ++k) {
      uint64_t gi = reverse ? total_groups - 1 - k : k;
      uint32_t gp[3] = {(uint32_t)(gi % ngroups[0]), (uint32_t)((gi / ngroups[0]) % ngroups[1]),
                        (uint32_t)(gi / ((uint64_t)ngroups[0] * ngroups[1]))};
      uint32_t act[3];  // dispatchThreads trims the edge threadgroups
      for (int d = 0; d < 3; ++d) act[d] = std::min(tg[d], grid[d] - gp[d] * tg[d]);
      int n = (int)(act[0] * act[1] * act[2]);
      int nsg = (n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
      int dispatch_n = (int)tg_size;
      r.lanes.assign((size_t)n, Lane());
      r.sgs.assign((size_t)nsg, SimdGroup());
      for (int s = 0; s < nsg; ++s) {
        int cnt = std::min(EMU_SIMD_WIDTH, n - s * EMU_SIMD_WIDTH);
        r.sgs[s].present = cnt == 32 ? 0xFFFFFFFFu : ((1u << cnt) - 1u);
      }
      for (int i = 0; i < n; ++i) {
        emu_thread_attrs& a = r.lanes[i].attrs;
        uint32_t p[3] = {(uint32_t)i % act[0], ((uint32_t)i / act[0]) % act[1], (uint32_t)i / (act[0] * act[1])};
        for (int d = 0; d < 3; ++d) {
          a.thread_position_in_threadgroup[d] = p[d];
          a.threadgroup_position_in_grid[d] = gp[d];
          a.thread_position_in_grid[d] = gp[d] * tg[d] + p[d];
          a.threads_per_threadgroup[d] = act[d];
          a.dispatch_threads_per_threadgroup[d] = tg[d];
          a.threadgroups_per_grid[d] = ngroups[d];
          a.threads_per_grid[d] = grid[d];
          a.grid_size[d] = grid[d];
          a.grid_origin[d] = 0;
        }
        a.thread_index_in_threadgroup = (uint32_t)i;
        a.thread_index_in_simdgroup = (uint32_t)i % EMU_SIMD_WIDTH;
        a.simdgroup_index_in_threadgroup = (uint32_t)i / EMU_SIMD_WIDTH;
        a.simdgroups_per_threadgroup = (uint32_t)nsg;
        a.dispatch_simdgroups_per_threadgroup = (uint32_t)((dispatch_n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH);
        a.threads_per_simdgroup = EMU_SIMD_WIDTH;
        a.thread_execution_width = EMU_SIMD_WIDTH;
        a.thread_index_in_quadgroup = (uint32_t)i % 4;
        a.quadgroup_index_in_threadgroup = (uint32_t)i / 4;
        a.quadgroups_per_threadgroup = (uint32_t)((n + 3) / 4);
        a.dispatch_quadgroups_per_threadgroup = (uint32_t)((dispatch_n + 3) / 4);
      }
      r.order.resize((size_t)n);
      for (int i = 0; i < n; ++i) r.order[(size_t)i] = reverse ? n - 1 - i : i;
      run_threadgroup(r);
    }
  } else if (g_sig) {
    int sig = g_sig;
    std::string who = g_sig_lane >= 0 && g_sig_lane < (int)r.lanes.size()
                          ? " [" + lane_name(r.lanes[(size_t)g_sig_lane]) + "]"
                          : "";
    if ((sig == SIGSEGV || sig == SIGBUS) && g_sig_code == SI_KERNEL && g_sig_addr == nullptr) {
      set_failure(r, "misaligned_access",
                  "general protection fault: most likely a vector load/store through a pointer that is "
                  "not aligned to the vector size (float4 needs 16 bytes, as on Metal)" + who);
    } else if (sig == SIGSEGV || sig == SIGBUS) {
      std::string what = describe_address((uintptr_t)g_sig_addr);
      const char* check = what.find("stack overflow") != std::string::npos ? "stack_overflow"
                          : what.find("read-only") != std::string::npos    ? "input_write"
                                                                           : "out_of_bounds";
      set_failure(r, check, what + who);
    } else if (sig == SIGILL) {
      set_failure(r, "illegal_instruction", "illegal instruction (a trap in the kernel)" + who);
    } else if (sig == SIGVTALRM) {
      set_failure(r, "timeout",
                  fmt("more than %.3g s of CPU time: an endless loop, or a spin-wait on another thread "
                      "(lanes run one at a time, without preemption)", cpu_seconds) + who);
    } else if (sig == SIGFPE) {
      set_failure(r, "integer_division", "integer division by zero" + who);
    } else {
      set_failure(r, "signal", fmt("signal %d", sig) + who);
    }
    g_sig = 0;
  }
  g_run = nullptr;
  if (r.failed) {
    snprintf(err, errlen, "%s\t%s", r.check.c_str(), r.detail.c_str());
    return 1;
  }
  return 0;
}

}  // extern "C"
