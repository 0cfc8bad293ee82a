// C ABI between the Metal shim (compiled into every kernel library) and the emulator runtime
// (one shared library, loaded once with RTLD_GLOBAL). Plain C types only.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define EMU_SIMD_WIDTH 32
#define EMU_SLOT_BYTES 64          // largest value one lane can post to a SIMD-group exchange
#define EMU_MAX_THREADS_PER_THREADGROUP 1024
#define EMU_THREADGROUP_MEMORY_BYTES 32768
#define EMU_POISON_BYTE0 0xA5      // poison/canary pattern: bytes A5 FF repeated (a NaN in f32/f16/bf16)
#define EMU_POISON_BYTE1 0xFF

#ifdef __cplusplus
extern "C" {
#endif

// Per-lane values of the Metal thread-position attributes.
typedef struct emu_thread_attrs {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t grid_size[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} emu_thread_attrs;

// The function every kernel library exports: runs the kernel body for one lane.
typedef void (*emu_lane_fn)(void* const* args, const emu_thread_attrs* attrs);

// ---- called from kernel code (shim) ----
// Block until every live lane of the threadgroup reached a threadgroup barrier (same source line).
void emu_threadgroup_barrier(unsigned site);
// Post `size` bytes, block until every live lane of the SIMD-group posted for the same op and line.
// Returns the 32 slots (EMU_SLOT_BYTES apart); *active = mask of participating lanes, *lane = caller.
const unsigned char* emu_simd_exchange(unsigned op, unsigned site, const void* value, unsigned size,
                                       uint32_t* active, unsigned* lane);
// Abort the run with a named check; never returns.
#ifdef __cplusplus
[[noreturn]]
#endif
void emu_fail(const char* check, const char* detail);
// Thread-position attributes of the calling lane.
const emu_thread_attrs* emu_current_attrs(void);
// Generation counter: changes at the start of every threadgroup of every run.
uint64_t emu_tg_generation(void);
// Register one threadgroup variable (canaries around it are checked at barriers and at the end).
void emu_tg_register(const char* name, const unsigned char* pre, size_t pre_bytes,
                     const unsigned char* post, size_t post_bytes, size_t data_bytes);

// ---- called from Python (ctypes) ----
void* emu_buffer_new(size_t nbytes, const char* name, size_t itemsize);
void emu_buffer_protect_readonly(void* data);
// 0 when the poison bytes around the data are intact; else 1 with *offset = byte offset (from the data
// start; negative = before it) of the first damaged byte.
int emu_buffer_check(void* data, long long* offset);
void emu_buffer_free(void* data);
// Run the whole grid (lanes and threadgroups in reverse order if `reverse`), at most `cpu_seconds`
// of CPU time (0: no limit). Returns 0, or nonzero with "check\tdetail" in err.
int emu_run(emu_lane_fn fn, void* const* args, const uint32_t grid[3], const uint32_t threadgroup[3],
            int reverse, int exited_lanes_in_simd_ok, double cpu_seconds, char* err, size_t errlen);

#ifdef __cplusplus
}
#endif
