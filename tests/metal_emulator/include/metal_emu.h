// metal_emu.h — the subset of the Metal Shading Language (and of MLX's auto-included Metal utils)
// that the project's kernels use, as plain C++17 for the CPU emulator.
//
// Rules: anything not defined here is a compile error (never a silent no-op); SIMD-group functions
// and barriers are real synchronization points handled by the emulator runtime (emu_abi.h).
// The address-space keywords are defined as empty macros at the END of this file, after every
// standard header, so our own code never depends on them. `threadgroup` is not a macro: the Python
// side rewrites threadgroup declarations (see rewrite.py) so that a mistaken use is a compile error.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <limits>
#include <type_traits>

#include "emu_abi.h"

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {

using ::half;

namespace emu {
template <class T>
struct is_arith : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, _Float16>::value> {};

constexpr uint16_t f32_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}
constexpr float bf16_to_f32(uint16_t b) { return __builtin_bit_cast(float, (uint32_t)b << 16); }

template <class T>
inline T poison() {
  T t;
  unsigned char* p = reinterpret_cast<unsigned char*>(&t);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = (i & 1) ? EMU_POISON_BYTE1 : EMU_POISON_BYTE0;
  return t;
}
}  // namespace emu

// ---------------------------------------------------------------------------------------------
// bfloat: 16-bit brain float, stored as bits; arithmetic in float, rounded to nearest even.
// bfloat op bfloat -> bfloat, bfloat op integer -> bfloat, bfloat op float/half -> float.
// ---------------------------------------------------------------------------------------------
struct bfloat {
  uint16_t __bits;
  struct bits_tag {};
  bfloat() = default;
  constexpr bfloat(uint16_t bits, bits_tag) : __bits(bits) {}
  template <class U, std::enable_if_t<emu::is_arith<U>::value, int> = 0>
  constexpr bfloat(U v) : __bits(emu::f32_to_bf16(static_cast<float>(v))) {}
  constexpr operator float() const { return emu::bf16_to_f32(__bits); }
  template <class U>
  bfloat& operator+=(const U& o) { return *this = bfloat(float(*this) + float(o)); }
  template <class U>
  bfloat& operator-=(const U& o) { return *this = bfloat(float(*this) - float(o)); }
  template <class U>
  bfloat& operator*=(const U& o) { return *this = bfloat(float(*this) * float(o)); }
  template <class U>
  bfloat& operator/=(const U& o) { return *this = bfloat(float(*this) / float(o)); }
};

constexpr bfloat operator-(bfloat a) { return bfloat((uint16_t)(a.__bits ^ 0x8000u), bfloat::bits_tag()); }
constexpr bfloat operator+(bfloat a) { return a; }

#define EMU_BF_ARITH(op)                                                                        \
  constexpr bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }    \
  constexpr float operator op(bfloat a, float b) { return float(a) op b; }                      \
  constexpr float operator op(float a, bfloat b) { return a op float(b); }                      \
  constexpr float operator op(bfloat a, half b) { return float(a) op float(b); }                \
  constexpr float operator op(half a, bfloat b) { return float(a) op float(b); }                \
  constexpr float operator op(bfloat a, double b) { return float(a) op float(b); }              \
  constexpr float operator op(double a, bfloat b) { return float(a) op float(b); }              \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                     \
  constexpr bfloat operator op(bfloat a, I b) { return bfloat(float(a) op float(b)); }         \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                     \
  constexpr bfloat operator op(I a, bfloat b) { return bfloat(float(a) op float(b)); }
EMU_BF_ARITH(+)
EMU_BF_ARITH(-)
EMU_BF_ARITH(*)
EMU_BF_ARITH(/)
#undef EMU_BF_ARITH

#define EMU_BF_CMP(op)                                                                          \
  constexpr bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }               \
  constexpr bool operator op(bfloat a, float b) { return float(a) op b; }                       \
  constexpr bool operator op(float a, bfloat b) { return a op float(b); }                       \
  constexpr bool operator op(bfloat a, half b) { return float(a) op float(b); }                 \
  constexpr bool operator op(half a, bfloat b) { return float(a) op float(b); }                 \
  constexpr bool operator op(bfloat a, double b) { return float(a) op float(b); }               \
  constexpr bool operator op(double a, bfloat b) { return float(a) op float(b); }               \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                     \
  constexpr bool operator op(bfloat a, I b) { return float(a) op float(b); }                    \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                     \
  constexpr bool operator op(I a, bfloat b) { return float(a) op float(b); }
EMU_BF_CMP(==)
EMU_BF_CMP(!=)
EMU_BF_CMP(<)
EMU_BF_CMP(<=)
EMU_BF_CMP(>)
EMU_BF_CMP(>=)
#undef EMU_BF_CMP

// Metal literal suffixes: 1.5h (half) and 1.5bf (bfloat).
constexpr half operator""h(long double v) { return (half)(float)v; }
constexpr bfloat operator""bf(long double v) { return bfloat((float)v); }

// ---------------------------------------------------------------------------------------------
// Vector types: vec<T, N> with .x/.y/.z/.w, [i], elementwise arithmetic, scalar broadcast.
// Size and alignment follow Metal (a 3-vector occupies 4 elements). No swizzles (.xy is an error).
// ---------------------------------------------------------------------------------------------
template <class T, int N>
struct vec_members;
template <class T>
struct vec_members<T, 2> { T x, y; };
template <class T>
struct vec_members<T, 3> { T x, y, z; };
template <class T>
struct vec_members<T, 4> { T x, y, z, w; };

template <class T, int N>
struct vec;

namespace emu {
template <class A>
struct components : std::integral_constant<int, 1> {};
template <class U, int M>
struct components<vec<U, M>> : std::integral_constant<int, M> {};
constexpr size_t vec_align(size_t s, int n) { return s * (n == 3 ? 4 : n); }
template <class... A>
constexpr int count_components() { return (0 + ... + components<std::decay_t<A>>::value); }
}  // namespace emu

template <class T, int N>
struct alignas(emu::vec_align(sizeof(T), N)) vec : vec_members<T, N> {
  typedef T element_type;
  vec() = default;
  vec(T s) {
    for (int i = 0; i < N; ++i) (*this)[i] = s;
  }
  template <class A, class B, class... R>
  vec(const A& a, const B& b, const R&... r) {
    static_assert(emu::count_components<A, B, R...>() == N, "wrong number of vector components");
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, r), ...);
  }
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);
  }
  T& operator[](int i) {
    if ((unsigned)i >= (unsigned)N) emu_fail("vector_index", "vector component index out of range");
    return (&this->x)[i];
  }
  const T& operator[](int i) const {
    if ((unsigned)i >= (unsigned)N) emu_fail("vector_index", "vector component index out of range");
    return (&this->x)[i];
  }

 private:
  template <class U, int M>
  void put(int& k, const vec<U, M>& v) {
    for (int i = 0; i < M; ++i) (*this)[k++] = static_cast<T>(v[i]);
  }
  template <class S, std::enable_if_t<emu::components<S>::value == 1, int> = 0>
  void put(int& k, const S& s) {
    (*this)[k++] = static_cast<T>(s);
  }

 public:
#define EMU_VEC_BINOP(op)                                                                       \
  friend vec operator op(const vec& a, const vec& b) {                                          \
    vec r;                                                                                      \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                            \
    return r;                                                                                   \
  }                                                                                             \
  friend vec operator op(const vec& a, T s) {                                                   \
    vec r;                                                                                      \
    for (int i = 0; i < N; ++i) r[i] = a[i] op s;                                               \
    return r;                                                                                   \
  }                                                                                             \
  friend vec operator op(T s, const vec& a) {                                                   \
    vec r;                                                                                      \
    for (int i = 0; i < N; ++i) r[i] = s op a[i];                                               \
    return r;                                                                                   \
  }                                                                                             \
  vec& operator op##=(const vec& b) {                                                           \
    for (int i = 0; i < N; ++i) (*this)[i] = (*this)[i] op b[i];                                \
    return *this;                                                                               \
  }                                                                                             \
  vec& operator op##=(T s) {                                                                    \
    for (int i = 0; i < N; ++i) (*this)[i] = (*this)[i] op s;                                   \
    return *this;                                                                               \
  }
  EMU_VEC_BINOP(+)
  EMU_VEC_BINOP(-)
  EMU_VEC_BINOP(*)
  EMU_VEC_BINOP(/)
  EMU_VEC_BINOP(%)
  EMU_VEC_BINOP(&)
  EMU_VEC_BINOP(|)
  EMU_VEC_BINOP(^)
  EMU_VEC_BINOP(<<)
  EMU_VEC_BINOP(>>)
#undef EMU_VEC_BINOP
#define EMU_VEC_CMP(op)                                                                         \
  friend vec<bool, N> operator op(const vec& a, const vec& b) {                                 \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                            \
    return r;                                                                                   \
  }                                                                                             \
  friend vec<bool, N> operator op(const vec& a, T s) {                                          \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = a[i] op s;                                               \
    return r;                                                                                   \
  }                                                                                             \
  friend vec<bool, N> operator op(T s, const vec& a) {                                          \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = s op a[i];                                               \
    return r;                                                                                   \
  }
  EMU_VEC_CMP(==)
  EMU_VEC_CMP(!=)
  EMU_VEC_CMP(<)
  EMU_VEC_CMP(<=)
  EMU_VEC_CMP(>)
  EMU_VEC_CMP(>=)
#undef EMU_VEC_CMP
  friend vec operator-(const vec& a) {
    vec r;
    for (int i = 0; i < N; ++i) r[i] = -a[i];
    return r;
  }
  friend vec operator+(const vec& a) { return a; }
  friend vec operator~(const vec& a) {
    vec r;
    for (int i = 0; i < N; ++i) r[i] = ~a[i];
    return r;
  }
  friend vec<bool, N> operator!(const vec& a) {
    vec<bool, N> r;
    for (int i = 0; i < N; ++i) r[i] = !a[i];
    return r;
  }
};

#define EMU_VEC_TYPEDEFS(T, name) \
  typedef vec<T, 2> name##2;      \
  typedef vec<T, 3> name##3;      \
  typedef vec<T, 4> name##4;
EMU_VEC_TYPEDEFS(float, float)
EMU_VEC_TYPEDEFS(half, half)
EMU_VEC_TYPEDEFS(bfloat, bfloat)
EMU_VEC_TYPEDEFS(int, int)
EMU_VEC_TYPEDEFS(uint, uint)
EMU_VEC_TYPEDEFS(short, short)
EMU_VEC_TYPEDEFS(ushort, ushort)
EMU_VEC_TYPEDEFS(char, char)
EMU_VEC_TYPEDEFS(uchar, uchar)
EMU_VEC_TYPEDEFS(long, long)
EMU_VEC_TYPEDEFS(ulong, ulong)
EMU_VEC_TYPEDEFS(bool, bool)
#undef EMU_VEC_TYPEDEFS

// Reinterpret the bits of a value as another type of the same size.
template <class To, class From>
inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination sizes differ");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

// ---------------------------------------------------------------------------------------------
// numeric_limits (std for built-in types; half and bfloat here)
// ---------------------------------------------------------------------------------------------
template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return __builtin_bit_cast(half, (uint16_t)0x0400); }
  static constexpr half max() { return __builtin_bit_cast(half, (uint16_t)0x7BFF); }
  static constexpr half lowest() { return __builtin_bit_cast(half, (uint16_t)0xFBFF); }
  static constexpr half epsilon() { return __builtin_bit_cast(half, (uint16_t)0x1400); }
  static constexpr half infinity() { return __builtin_bit_cast(half, (uint16_t)0x7C00); }
  static constexpr half quiet_NaN() { return __builtin_bit_cast(half, (uint16_t)0x7E00); }
  static constexpr half denorm_min() { return __builtin_bit_cast(half, (uint16_t)0x0001); }
};

template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return bfloat(0x0080, bfloat::bits_tag()); }
  static constexpr bfloat max() { return bfloat(0x7F7F, bfloat::bits_tag()); }
  static constexpr bfloat lowest() { return bfloat(0xFF7F, bfloat::bits_tag()); }
  static constexpr bfloat epsilon() { return bfloat(0x3C00, bfloat::bits_tag()); }
  static constexpr bfloat infinity() { return bfloat(0x7F80, bfloat::bits_tag()); }
  static constexpr bfloat quiet_NaN() { return bfloat(0x7FC0, bfloat::bits_tag()); }
  static constexpr bfloat denorm_min() { return bfloat(0x0001, bfloat::bits_tag()); }
};

// ---------------------------------------------------------------------------------------------
// Math. Float functions exist for float, half and bfloat (computed in float, rounded back) and
// elementwise for vectors; mixed scalar types are ambiguous, as in Metal: cast explicitly.
// max/min/fmax/fmin propagate NaN on purpose so that reads of poison (NaN) show up in results.
// fast:: and precise:: are the same functions (the emulator does not model fast-math).
// ---------------------------------------------------------------------------------------------
namespace emu {
inline bool isnan_f(float x) { return x != x; }
inline float max_f(float a, float b) { return (isnan_f(a) || isnan_f(b)) ? __builtin_nanf("") : (a > b ? a : b); }
inline float min_f(float a, float b) { return (isnan_f(a) || isnan_f(b)) ? __builtin_nanf("") : (a < b ? a : b); }
inline float fract_f(float x) {
  float f = x - __builtin_floorf(x);
  return f < 0x1.fffffep-1f ? f : 0x1.fffffep-1f;
}
inline float sign_f(float x) {
  if (isnan_f(x)) return 0.0f;
  if (x > 0.0f) return 1.0f;
  if (x < 0.0f) return -1.0f;
  return x;
}
}  // namespace emu

// Integer functions.
#define EMU_INT_TYPES(M) \
  M(char)                \
  M(int8_t)              \
  M(uchar)                \
  M(short)               \
  M(ushort)               \
  M(int)                 \
  M(uint)                 \
  M(long)                \
  M(ulong)
#define EMU_INT_FUNCS(T)                                                                     \
  inline T max(T a, T b) { return a > b ? a : b; }                                          \
  inline T min(T a, T b) { return a < b ? a : b; }                                          \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }                           \
  inline T abs(T x) { return std::is_signed<T>::value && x < T(0) ? T(-x) : x; }             \
  inline T absdiff(T a, T b) { return a > b ? T(a - b) : T(b - a); }                         \
  inline T popcount(T x) { return (T)__builtin_popcountll((unsigned long long)(std::make_unsigned_t<T>)x); } \
  inline T clz(T x) {                                                                        \
    unsigned long long u = (unsigned long long)(std::make_unsigned_t<T>)x;                   \
    const int bits = 8 * (int)sizeof(T);                                                     \
    return (T)(u == 0 ? bits : __builtin_clzll(u) - (64 - bits));                            \
  }                                                                                          \
  inline T ctz(T x) {                                                                        \
    unsigned long long u = (unsigned long long)(std::make_unsigned_t<T>)x;                   \
    return (T)(u == 0 ? 8 * (int)sizeof(T) : __builtin_ctzll(u));                            \
  }                                                                                          \
  inline T extract_bits(T x, uint offset, uint bits) {                                      \
    typedef std::make_unsigned_t<T> U;                                                       \
    if (bits == 0) return T(0);                                                              \
    U v = (U)((U)x >> offset);                                                               \
    U mask = bits >= 8 * sizeof(T) ? (U)~(U)0 : (U)(((U)1 << bits) - 1);                     \
    v &= mask;                                                                               \
    if (std::is_signed<T>::value && bits < 8 * sizeof(T) && (v >> (bits - 1)) & 1) v |= (U)~mask; \
    return (T)v;                                                                             \
  }
EMU_INT_TYPES(EMU_INT_FUNCS)
#undef EMU_INT_FUNCS
#undef EMU_INT_TYPES

#define EMU_FLOAT_TYPES(M, ...) \
  M(float, __VA_ARGS__)         \
  M(half, __VA_ARGS__)          \
  M(bfloat, __VA_ARGS__)

#define EMU_UNARY_ONE(T, name, expr) \
  inline T name(T x_) {              \
    float x = float(x_);             \
    return T(expr);                  \
  }
#define EMU_UNARY(name, expr)                                 \
  EMU_FLOAT_TYPES(EMU_UNARY_ONE, name, expr)                  \
  inline float name(double x_) { return name(float(x_)); }    \
  template <class T, int N>                                   \
  inline vec<T, N> name(const vec<T, N>& v) {                 \
    vec<T, N> r;                                              \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);            \
    return r;                                                 \
  }

EMU_UNARY(exp, __builtin_expf(x))
EMU_UNARY(exp2, __builtin_exp2f(x))
EMU_UNARY(exp10, __builtin_powf(10.0f, x))
EMU_UNARY(log, __builtin_logf(x))
EMU_UNARY(log2, __builtin_log2f(x))
EMU_UNARY(log10, __builtin_log10f(x))
EMU_UNARY(sqrt, __builtin_sqrtf(x))
EMU_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
EMU_UNARY(sin, __builtin_sinf(x))
EMU_UNARY(cos, __builtin_cosf(x))
EMU_UNARY(tan, __builtin_tanf(x))
EMU_UNARY(asin, __builtin_asinf(x))
EMU_UNARY(acos, __builtin_acosf(x))
EMU_UNARY(atan, __builtin_atanf(x))
EMU_UNARY(sinh, __builtin_sinhf(x))
EMU_UNARY(cosh, __builtin_coshf(x))
EMU_UNARY(tanh, __builtin_tanhf(x))
EMU_UNARY(asinh, __builtin_asinhf(x))
EMU_UNARY(acosh, __builtin_acoshf(x))
EMU_UNARY(atanh, __builtin_atanhf(x))
EMU_UNARY(floor, __builtin_floorf(x))
EMU_UNARY(ceil, __builtin_ceilf(x))
EMU_UNARY(round, __builtin_roundf(x))
EMU_UNARY(rint, __builtin_rintf(x))
EMU_UNARY(trunc, __builtin_truncf(x))
EMU_UNARY(fabs, __builtin_fabsf(x))
EMU_UNARY(fract, emu::fract_f(x))
EMU_UNARY(sign, emu::sign_f(x))
EMU_UNARY(saturate, emu::min_f(emu::max_f(x, 0.0f), 1.0f))
EMU_UNARY_ONE(float, abs, __builtin_fabsf(x))
EMU_UNARY_ONE(half, abs, __builtin_fabsf(x))
EMU_UNARY_ONE(bfloat, abs, __builtin_fabsf(x))
#undef EMU_UNARY
#undef EMU_UNARY_ONE

#define EMU_PRED_ONE(T, name, expr) \
  inline bool name(T x_) {          \
    float x = float(x_);            \
    return (expr);                  \
  }
EMU_FLOAT_TYPES(EMU_PRED_ONE, isnan, x != x)
EMU_FLOAT_TYPES(EMU_PRED_ONE, isinf, __builtin_isinf(x))
EMU_FLOAT_TYPES(EMU_PRED_ONE, isfinite, __builtin_isfinite(x))
EMU_FLOAT_TYPES(EMU_PRED_ONE, signbit, __builtin_signbit(x) != 0)
#undef EMU_PRED_ONE

#define EMU_BINARY_ONE(T, name, expr) \
  inline T name(T a_, T b_) {         \
    float a = float(a_), b = float(b_); \
    return T(expr);                   \
  }
#define EMU_BINARY(name, expr)                                                         \
  EMU_FLOAT_TYPES(EMU_BINARY_ONE, name, expr)                                          \
  inline float name(double a, double b) { return name(float(a), float(b)); }           \
  template <class T, int N>                                                            \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                      \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                               \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N>                                                            \
  inline vec<T, N> name(const vec<T, N>& a, T b) {                                     \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b);                                  \
    return r;                                                                          \
  }
EMU_BINARY(max, emu::max_f(a, b))
EMU_BINARY(min, emu::min_f(a, b))
EMU_BINARY(fmax, emu::max_f(a, b))
EMU_BINARY(fmin, emu::min_f(a, b))
EMU_BINARY(pow, __builtin_powf(a, b))
EMU_BINARY(powr, __builtin_powf(a, b))
EMU_BINARY(atan2, __builtin_atan2f(a, b))
EMU_BINARY(fmod, __builtin_fmodf(a, b))
EMU_BINARY(copysign, __builtin_copysignf(a, b))
EMU_BINARY(fdim, (a > b ? a - b : 0.0f))
EMU_BINARY(step, (b < a ? 0.0f : 1.0f))
#undef EMU_BINARY
#undef EMU_BINARY_ONE

#define EMU_TERNARY_ONE(T, name, expr)                \
  inline T name(T a_, T b_, T c_) {                   \
    float a = float(a_), b = float(b_), c = float(c_); \
    return T(expr);                                   \
  }
#define EMU_TERNARY(name, expr)                                                           \
  EMU_FLOAT_TYPES(EMU_TERNARY_ONE, name, expr)                                            \
  template <class T, int N>                                                               \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {     \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i], c[i]);                            \
    return r;                                                                             \
  }
EMU_TERNARY(fma, __builtin_fmaf(a, b, c))
EMU_TERNARY(mix, a + (b - a) * c)
EMU_TERNARY(clamp, emu::min_f(emu::max_f(a, b), c))
#undef EMU_TERNARY
#undef EMU_TERNARY_ONE

template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = clamp(x[i], lo, hi);
  return r;
}
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& a, const vec<T, N>& b, T t) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = mix(a[i], b[i], t);
  return r;
}
template <class T, int N>
inline vec<T, N> step(T edge, const vec<T, N>& x) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = step(edge, x[i]);
  return r;
}

template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(a[i]);
  return r;
}

// select(a, b, c): c ? b : a.
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T r = a[0] * b[0];
  for (int i = 1; i < N; ++i) r = r + a[i] * b[i];
  return r;
}
template <class T, int N>
inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }

namespace fast {
using metal::abs; using metal::acos; using metal::asin; using metal::atan; using metal::atan2;
using metal::ceil; using metal::clamp; using metal::cos; using metal::cosh; using metal::exp;
using metal::exp10; using metal::exp2; using metal::fabs; using metal::floor; using metal::fmax;
using metal::fmin; using metal::fmod; using metal::fract; using metal::log; using metal::log10;
using metal::log2; using metal::max; using metal::min; using metal::pow; using metal::powr;
using metal::rint; using metal::round; using metal::rsqrt; using metal::saturate; using metal::sign;
using metal::sin; using metal::sinh; using metal::sqrt; using metal::tan; using metal::tanh;
using metal::trunc;
inline float divide(float a, float b) { return a / b; }
}  // namespace fast
namespace precise {
using namespace metal::fast;
}  // namespace precise

// ---------------------------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------------------------
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                                  mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((unsigned)a | (unsigned)b); }

inline void threadgroup_barrier(mem_flags, unsigned __site = __builtin_LINE()) { emu_threadgroup_barrier(__site); }

// ---------------------------------------------------------------------------------------------
// SIMD-group functions (32 lanes). Each call is a synchronization point: every live lane of the
// SIMD-group must reach the same function on the same source line, else the run fails
// (simd_divergence). Reductions combine lanes pairwise in a fixed tree (lane l with l+16, +8, ...).
// Reading from a lane that does not exist returns poison (NaN bits).
// ---------------------------------------------------------------------------------------------
namespace emu {
enum simd_op : unsigned {
  op_sum = 1, op_product, op_min, op_max, op_and, op_or, op_xor, op_shuffle, op_shuffle_xor,
  op_shuffle_down, op_shuffle_up, op_rotate_down, op_rotate_up, op_broadcast, op_broadcast_first,
  op_prefix_excl_sum, op_prefix_incl_sum, op_prefix_excl_product, op_prefix_incl_product, op_all,
  op_any, op_ballot, op_is_first, op_simd_barrier, op_active_mask, op_matrix_load, op_matrix_store,
  op_matrix_mac, op_matrix_mul
};

template <class T>
struct packet {
  T value;
  uint32_t arg;
};

template <class T>
struct exchanged {
  const unsigned char* base;
  uint32_t active;
  unsigned lane;
  bool has(unsigned l) const { return l < EMU_SIMD_WIDTH && ((active >> l) & 1u); }
  packet<T> at(unsigned l) const {
    packet<T> p;
    memcpy(&p, base + (size_t)l * EMU_SLOT_BYTES, sizeof p);
    return p;
  }
  T value(unsigned l) const { return has(l) ? at(l).value : poison<T>(); }
  unsigned first() const { return (unsigned)__builtin_ctz(active); }
};

template <class T>
inline exchanged<T> exchange(simd_op op, unsigned site, const T& v, uint32_t arg) {
  static_assert(sizeof(packet<T>) <= EMU_SLOT_BYTES, "SIMD-group value too large for the emulator");
  static_assert(std::is_trivially_copyable<T>::value, "SIMD-group value must be trivially copyable");
  packet<T> p;
  memset(&p, 0, sizeof p);
  p.value = v;
  p.arg = arg;
  exchanged<T> r;
  r.base = emu_simd_exchange(op, site, &p, sizeof p, &r.active, &r.lane);
  return r;
}

template <class T>
inline void require_uniform(const exchanged<T>& r, const char* fn) {
  uint32_t a = r.at(r.first()).arg;
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l) {
    if (r.has(l) && r.at(l).arg != a) emu_fail("simd_nonuniform_argument", fn);
  }
}

template <class T, class F>
inline T tree_reduce(const exchanged<T>& r, F f) {
  T v[EMU_SIMD_WIDTH];
  bool h[EMU_SIMD_WIDTH];
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l) {
    h[l] = r.has(l);
    if (h[l]) v[l] = r.at(l).value;
  }
  for (unsigned off = EMU_SIMD_WIDTH / 2; off >= 1; off >>= 1) {
    for (unsigned l = 0; l < off; ++l) {
      if (h[l] && h[l + off]) {
        v[l] = f(v[l], v[l + off]);
      } else if (h[l + off]) {
        v[l] = v[l + off];
        h[l] = true;
      }
    }
  }
  return v[0];
}

template <class T, class F>
inline T prefix(const exchanged<T>& r, F f, T init, bool inclusive) {
  T acc = init;
  for (unsigned l = 0; l < r.lane; ++l)
    if (r.has(l)) acc = f(acc, r.at(l).value);
  if (inclusive) acc = f(acc, r.at(r.lane).value);
  return acc;
}

struct plus_f { template <class T> T operator()(const T& a, const T& b) const { return a + b; } };
struct times_f { template <class T> T operator()(const T& a, const T& b) const { return a * b; } };
struct max_fn { template <class T> T operator()(const T& a, const T& b) const { return metal::max(a, b); } };
struct min_fn { template <class T> T operator()(const T& a, const T& b) const { return metal::min(a, b); } };
struct and_f { template <class T> T operator()(const T& a, const T& b) const { return a & b; } };
struct or_f { template <class T> T operator()(const T& a, const T& b) const { return a | b; } };
struct xor_f { template <class T> T operator()(const T& a, const T& b) const { return a ^ b; } };
}  // namespace emu

#define EMU_SIMD_REDUCE(name, op, fn)                                        \
  template <class T>                                                         \
  inline T name(T x, unsigned __site = __builtin_LINE()) {                   \
    return emu::tree_reduce(emu::exchange(emu::op, __site, x, 0u), emu::fn()); \
  }
EMU_SIMD_REDUCE(simd_sum, op_sum, plus_f)
EMU_SIMD_REDUCE(simd_product, op_product, times_f)
EMU_SIMD_REDUCE(simd_max, op_max, max_fn)
EMU_SIMD_REDUCE(simd_min, op_min, min_fn)
EMU_SIMD_REDUCE(simd_and, op_and, and_f)
EMU_SIMD_REDUCE(simd_or, op_or, or_f)
EMU_SIMD_REDUCE(simd_xor, op_xor, xor_f)
#undef EMU_SIMD_REDUCE

template <class T>
inline T simd_prefix_exclusive_sum(T x, unsigned __site = __builtin_LINE()) {
  return emu::prefix(emu::exchange(emu::op_prefix_excl_sum, __site, x, 0u), emu::plus_f(), T(0), false);
}
template <class T>
inline T simd_prefix_inclusive_sum(T x, unsigned __site = __builtin_LINE()) {
  return emu::prefix(emu::exchange(emu::op_prefix_incl_sum, __site, x, 0u), emu::plus_f(), T(0), true);
}
template <class T>
inline T simd_prefix_exclusive_product(T x, unsigned __site = __builtin_LINE()) {
  return emu::prefix(emu::exchange(emu::op_prefix_excl_product, __site, x, 0u), emu::times_f(), T(1), false);
}
template <class T>
inline T simd_prefix_inclusive_product(T x, unsigned __site = __builtin_LINE()) {
  return emu::prefix(emu::exchange(emu::op_prefix_incl_product, __site, x, 0u), emu::times_f(), T(1), true);
}

template <class T>
inline T simd_shuffle(T x, ushort lane_id, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_shuffle, __site, x, (uint32_t)lane_id);
  return r.value(lane_id);
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_shuffle_xor, __site, x, (uint32_t)mask);
  emu::require_uniform(r, "simd_shuffle_xor: mask differs between lanes");
  return r.value(r.lane ^ mask);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_shuffle_down, __site, x, (uint32_t)delta);
  emu::require_uniform(r, "simd_shuffle_down: delta differs between lanes");
  unsigned src = r.lane + delta;
  return src >= EMU_SIMD_WIDTH ? x : r.value(src);  // the upper delta lanes keep their value
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_shuffle_up, __site, x, (uint32_t)delta);
  emu::require_uniform(r, "simd_shuffle_up: delta differs between lanes");
  return delta > r.lane ? x : r.value(r.lane - delta);  // the lower delta lanes keep their value
}
template <class T>
inline T simd_shuffle_rotate_down(T x, ushort delta, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_rotate_down, __site, x, (uint32_t)delta);
  emu::require_uniform(r, "simd_shuffle_rotate_down: delta differs between lanes");
  return r.value((r.lane + delta) % EMU_SIMD_WIDTH);
}
template <class T>
inline T simd_shuffle_rotate_up(T x, ushort delta, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_rotate_up, __site, x, (uint32_t)delta);
  emu::require_uniform(r, "simd_shuffle_rotate_up: delta differs between lanes");
  return r.value((r.lane + EMU_SIMD_WIDTH - delta % EMU_SIMD_WIDTH) % EMU_SIMD_WIDTH);
}
template <class T>
inline T simd_broadcast(T x, ushort lane_id, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_broadcast, __site, x, (uint32_t)lane_id);
  emu::require_uniform(r, "simd_broadcast: lane differs between lanes");
  return r.value(lane_id);
}
template <class T>
inline T simd_broadcast_first(T x, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_broadcast_first, __site, x, 0u);
  return r.value(r.first());
}
inline bool simd_all(bool b, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_all, __site, b, 0u);
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l)
    if (r.has(l) && !r.at(l).value) return false;
  return true;
}
inline bool simd_any(bool b, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_any, __site, b, 0u);
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l)
    if (r.has(l) && r.at(l).value) return true;
  return false;
}
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t __v;
  explicit constexpr simd_vote(vote_t v = 0) : __v(v) {}
  explicit constexpr operator vote_t() const { return __v; }
  constexpr bool all() const { return __v == 0xFFFFFFFFull; }
  constexpr bool any() const { return __v != 0; }
};
inline simd_vote simd_ballot(bool b, unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_ballot, __site, b, 0u);
  uint64_t m = 0;
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l)
    if (r.has(l) && r.at(l).value) m |= 1ull << l;
  return simd_vote(m);
}
inline simd_vote simd_active_threads_mask(unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_active_mask, __site, false, 0u);
  return simd_vote(r.active);
}
inline bool simd_is_first(unsigned __site = __builtin_LINE()) {
  auto r = emu::exchange(emu::op_is_first, __site, false, 0u);
  return r.lane == r.first();
}
inline void simdgroup_barrier(mem_flags, unsigned __site = __builtin_LINE()) {
  (void)emu::exchange(emu::op_simd_barrier, __site, false, 0u);
}

// ---------------------------------------------------------------------------------------------
// Atomics (device/threadgroup). Lanes run one at a time, so plain read-modify-write is atomic.
// ---------------------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed = 0, memory_order_acquire = 2, memory_order_release = 3,
                    memory_order_acq_rel = 4, memory_order_seq_cst = 5 };
template <class T>
struct atomic {
  T __value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

namespace emu {
template <class T>
struct same { typedef T type; };
template <class T>
inline T& atomic_ref(volatile atomic<T>* o) { return const_cast<atomic<T>*>(o)->__value; }
}  // namespace emu

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* o, typename emu::same<T>::type v, memory_order) {
  emu::atomic_ref(o) = v;
}
template <class T>
inline T atomic_load_explicit(volatile atomic<T>* o, memory_order) { return emu::atomic_ref(o); }
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* o, typename emu::same<T>::type v, memory_order) {
  T old = emu::atomic_ref(o);
  emu::atomic_ref(o) = v;
  return old;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected,
                                                  typename emu::same<T>::type desired, memory_order,
                                                  memory_order) {
  T& cur = emu::atomic_ref(o);
  if (memcmp(&cur, expected, sizeof(T)) == 0) {
    cur = desired;
    return true;
  }
  *expected = cur;
  return false;
}
#define EMU_ATOMIC_RMW(name, expr)                                                                    \
  template <class T>                                                                                  \
  inline T name(volatile atomic<T>* o, typename emu::same<T>::type v, memory_order) {                 \
    T& cur = emu::atomic_ref(o);                                                                      \
    T old = cur;                                                                                      \
    cur = (expr);                                                                                     \
    return old;                                                                                       \
  }
EMU_ATOMIC_RMW(atomic_fetch_add_explicit, old + v)
EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, old - v)
EMU_ATOMIC_RMW(atomic_fetch_and_explicit, old & v)
EMU_ATOMIC_RMW(atomic_fetch_or_explicit, old | v)
EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ v)
EMU_ATOMIC_RMW(atomic_fetch_max_explicit, metal::max(old, v))
EMU_ATOMIC_RMW(atomic_fetch_min_explicit, metal::min(old, v))
#undef EMU_ATOMIC_RMW

// ---------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>: each lane holds two elements in Apple's layout (the one MLX's steel
// kernels rely on): lane l holds row (l/4 & 4) + (l/2 % 4), columns (l/4 & 2)*2 + (l%2)*2 and +1.
// load/store/multiply are SIMD-group functions (synchronizing, arguments must be uniform);
// products accumulate in float in k order, then round to the destination type.
// ---------------------------------------------------------------------------------------------
namespace emu {
inline void sg_coord(unsigned lane, int& row, int& col) {
  unsigned qid = lane / 4;
  row = (int)((qid & 4) + ((lane / 2) % 4));
  col = (int)((qid & 2) * 2 + (lane % 2) * 2);
}
struct matrix_io {
  const void* ptr;
  uint64_t elements_per_row, origin_x, origin_y;
  uint32_t transpose;
};
template <class T>
inline void require_uniform_value(const exchanged<T>& r, const char* what) {
  packet<T> first = r.at(r.first());
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l)
    if (r.has(l)) {
      packet<T> p = r.at(l);
      if (memcmp(&p.value, &first.value, sizeof(T)) != 0) emu_fail("simd_nonuniform_argument", what);
    }
}
}  // namespace emu

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator implements 8x8 simdgroup matrices only");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {  // diagonal matrix
    int r, c;
    emu::sg_coord(emu_current_attrs()->thread_index_in_simdgroup, r, c);
    __e[0] = r == c ? diagonal : T(0);
    __e[1] = r == c + 1 ? diagonal : T(0);
  }
  vec<T, 2>& thread_elements() { return __e; }
  const vec<T, 2>& thread_elements() const { return __e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.__e = vec<T, 2>(value);
  return m;
}

template <class T, int Cols, int Rows>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                           unsigned __site = __builtin_LINE()) {
  emu::matrix_io io{src, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  auto r = emu::exchange(emu::op_matrix_load, __site, io, 0u);
  emu::require_uniform_value(r, "simdgroup_load: arguments differ between lanes");
  int row, col;
  emu::sg_coord(r.lane, row, col);
  for (int k = 0; k < 2; ++k) {
    int rr = transpose_matrix ? col + k : row, cc = transpose_matrix ? row : col + k;
    d.__e[k] = src[(matrix_origin.y + rr) * elements_per_row + matrix_origin.x + cc];
  }
}
template <class T, int Cols, int Rows>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, ulong elements_per_row = Cols,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                            unsigned __site = __builtin_LINE()) {
  emu::matrix_io io{dst, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  auto r = emu::exchange(emu::op_matrix_store, __site, io, 0u);
  emu::require_uniform_value(r, "simdgroup_store: arguments differ between lanes");
  int row, col;
  emu::sg_coord(r.lane, row, col);
  for (int k = 0; k < 2; ++k) {
    int rr = transpose_matrix ? col + k : row, cc = transpose_matrix ? row : col + k;
    dst[(matrix_origin.y + rr) * elements_per_row + matrix_origin.x + cc] = a.__e[k];
  }
}

namespace emu {
template <class A, class B, class C>
struct mac_operands {
  vec<A, 2> a;
  vec<B, 2> b;
  vec<C, 2> c;
};
template <class D, class A, class B, class C>
inline void matrix_mac(simd_op op, unsigned site, vec<D, 2>& d, const vec<A, 2>& a, const vec<B, 2>& b,
                       const vec<C, 2>& c, bool accumulate) {
  auto r = exchange(op, site, mac_operands<A, B, C>{a, b, c}, 0u);
  if (r.active != 0xFFFFFFFFu) emu_fail("simd_divergence", "simdgroup matrix multiply needs all 32 lanes");
  float fa[8][8], fb[8][8], fc[8][8];
  for (unsigned l = 0; l < EMU_SIMD_WIDTH; ++l) {
    int row, col;
    sg_coord(l, row, col);
    mac_operands<A, B, C> m = r.at(l).value;
    for (int k = 0; k < 2; ++k) {
      fa[row][col + k] = float(m.a[k]);
      fb[row][col + k] = float(m.b[k]);
      fc[row][col + k] = float(m.c[k]);
    }
  }
  int row, col;
  sg_coord(r.lane, row, col);
  for (int k = 0; k < 2; ++k) {
    float acc = 0.0f;
    for (int j = 0; j < 8; ++j) acc += fa[row][j] * fb[j][col + k];
    d[k] = D(accumulate ? acc + fc[row][col + k] : acc);
  }
}
}  // namespace emu

template <class D, class A, class B, class C>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<D, 8, 8>& d, const simdgroup_matrix<A, 8, 8>& a,
                                          const simdgroup_matrix<B, 8, 8>& b, const simdgroup_matrix<C, 8, 8>& c,
                                          unsigned __site = __builtin_LINE()) {
  emu::matrix_mac(emu::op_matrix_mac, __site, d.__e, a.__e, b.__e, c.__e, true);
}
template <class D, class A, class B>
inline void simdgroup_multiply(simdgroup_matrix<D, 8, 8>& d, const simdgroup_matrix<A, 8, 8>& a,
                               const simdgroup_matrix<B, 8, 8>& b, unsigned __site = __builtin_LINE()) {
  emu::matrix_mac(emu::op_matrix_mul, __site, d.__e, a.__e, b.__e, a.__e, false);
}

#undef EMU_FLOAT_TYPES
}  // namespace metal

// ---------------------------------------------------------------------------------------------
// Threadgroup storage. rewrite.py turns `threadgroup T name[N];` into a static emu::tg_storage
// (shared by all lanes, since one threadgroup runs at a time) and a reference `name` into it. The
// storage is poisoned when the first lane of each threadgroup reaches the declaration, and framed
// by canaries that the runtime checks at every barrier and at the end of the threadgroup.
// ---------------------------------------------------------------------------------------------
namespace emu {
template <class T>
struct tg_storage {
  unsigned char pre[64];
  alignas(alignof(T) > 16 ? alignof(T) : 16) unsigned char data[sizeof(T)];
  unsigned char post[64];
  uint64_t generation;
  T& get(const char* name) {
    uint64_t g = emu_tg_generation();
    if (generation != g) {
      generation = g;
      unsigned char* all[3] = {pre, data, post};
      size_t sizes[3] = {sizeof pre, sizeof(T), sizeof post};
      for (int k = 0; k < 3; ++k)
        for (size_t i = 0; i < sizes[k]; ++i) all[k][i] = (i & 1) ? EMU_POISON_BYTE1 : EMU_POISON_BYTE0;
      emu_tg_register(name, pre, sizeof pre, post, sizeof post, sizeof(T));
    }
    return *reinterpret_cast<T*>(data);
  }
};
}  // namespace emu

using namespace metal;

// ---------------------------------------------------------------------------------------------
// Equivalents of MLX's auto-included Metal utils (bf16.h, utils.h, defines.h) that kernels may use.
// ---------------------------------------------------------------------------------------------
typedef half float16_t;
typedef bfloat bfloat16_t;

#define METAL_FUNC inline
#define MLX_MTL_PRAGMA_UNROLL
#define MLX_MTL_LOOP_UNROLL
#define MLX_MTL_CONST static constexpr const

template <typename U, bool F = std::is_floating_point<U>::value || std::is_same<U, half>::value ||
                               std::is_same<U, bfloat>::value>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
template <typename U>
struct Limits<U, true> {
  static constexpr U max = metal::numeric_limits<U>::infinity();
  static constexpr U min = -metal::numeric_limits<U>::infinity();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = -metal::numeric_limits<U>::max();
};
template <>
struct Limits<bool, false> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename StrideT, typename ElemT>
inline StrideT elem_to_loc(ElemT elem, const int* shape, const StrideT* strides, int ndim) {
  StrideT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += StrideT(elem % shape[i]) * strides[i];
    elem /= shape[i];
  }
  return loc;
}
template <typename StrideT>
inline StrideT elem_to_loc(uint3 elem, const int* shape, const StrideT* strides, int ndim) {
  StrideT loc = StrideT(elem.x) * strides[ndim - 1] + StrideT(elem.y) * strides[ndim - 2];
  for (int d = ndim - 3; d >= 0; --d) {
    loc += StrideT(elem.z % shape[d]) * strides[d];
    elem.z /= shape[d];
  }
  return loc;
}
inline size_t ceildiv(size_t n, size_t m) { return (n + m - 1) / m; }

#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
#define HUGE_VALF __builtin_inff()
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define MAXFLOAT __FLT_MAX__
#define HALF_MAX 65504.0f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f

// Address spaces carry no meaning on the CPU (buffers are bounds-guarded by the runtime instead).
#define device
#define constant
#define thread
