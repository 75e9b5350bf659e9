// Values a request carries and a result holds: msgpack data with tensors inside.
//
//   Value       nil | bool | int | uint | double | string | binary | array | map (str keys, in order)
//               | TensorView (a request tensor: borrowed bytes, copied into a frame by submit)
//               | Tensor     (a result tensor: a view of the received frame, kept alive with it)
//
// Tensors are (dtype, shape, bytes): little-endian, C order, dtypes of docs/protocol.md's allow-list.
// bfloat16 and float16 have no C++ type here: read them as std::uint16_t bits (as_bits()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace phyrt {

enum class DType { float16, float32, float64, bfloat16, int8, int16, int32, int64, uint8, boolean };

struct DTypeInfo {
  DType dtype;
  const char* name;  // the wire name
  std::size_t itemsize;
};

inline constexpr DTypeInfo kDTypes[] = {
    {DType::float16, "float16", 2}, {DType::float32, "float32", 4}, {DType::float64, "float64", 8},
    {DType::bfloat16, "bfloat16", 2}, {DType::int8, "int8", 1},     {DType::int16, "int16", 2},
    {DType::int32, "int32", 4},     {DType::int64, "int64", 8},     {DType::uint8, "uint8", 1},
    {DType::boolean, "bool", 1}};

inline const DTypeInfo& dtype_info(DType dtype) { return kDTypes[static_cast<int>(dtype)]; }
inline const char* dtype_name(DType dtype) { return dtype_info(dtype).name; }
inline std::size_t itemsize(DType dtype) { return dtype_info(dtype).itemsize; }

inline std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& info : kDTypes)
    if (name == info.name) return info.dtype;
  return std::nullopt;
}

// The element count of a shape (1 for a scalar's empty shape).
inline std::uint64_t numel(const std::vector<std::uint64_t>& shape) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

template <class T> constexpr std::optional<DType> native_dtype() {
  if constexpr (std::is_same_v<T, float>) return DType::float32;
  else if constexpr (std::is_same_v<T, double>) return DType::float64;
  else if constexpr (std::is_same_v<T, std::int8_t>) return DType::int8;
  else if constexpr (std::is_same_v<T, std::int16_t>) return DType::int16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::int64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::uint8;
  else if constexpr (std::is_same_v<T, bool>) return DType::boolean;
  else return std::nullopt;
}

// A request tensor: the caller's bytes, valid until submit() returns (submit copies them once).
struct TensorView {
  DType dtype;
  std::vector<std::uint64_t> shape;
  const void* data;
  std::size_t nbytes;

  template <class T> static TensorView of(const T* data, std::vector<std::uint64_t> shape) {
    static_assert(native_dtype<T>().has_value(), "no wire dtype for this type: use the DType constructor");
    std::size_t n = static_cast<std::size_t>(numel(shape)) * sizeof(T);
    return TensorView{*native_dtype<T>(), std::move(shape), data, n};
  }
};

// A result tensor: a read-only view of the frame it arrived in (no copy); copies share the frame.
class Tensor {
 public:
  Tensor(DType dtype, std::vector<std::uint64_t> shape, std::shared_ptr<const void> owner, const std::uint8_t* data,
         std::size_t nbytes)
      : dtype_(dtype), shape_(std::move(shape)), owner_(std::move(owner)), data_(data), nbytes_(nbytes) {}

  DType dtype() const noexcept { return dtype_; }
  const std::vector<std::uint64_t>& shape() const noexcept { return shape_; }
  const std::uint8_t* data() const noexcept { return data_; }
  std::size_t nbytes() const noexcept { return nbytes_; }
  std::uint64_t numel() const noexcept { return phyrt::numel(shape_); }

  // The elements as T, which must match dtype(): float for float32, std::int64_t for int64, ...
  // Frames may be unaligned, so the elements are copied out.
  template <class T> std::vector<T> to_vector() const {
    if (native_dtype<T>() != dtype_)
      throw std::invalid_argument(std::string("tensor of dtype ") + dtype_name(dtype_) + " read as another type");
    std::vector<T> out(static_cast<std::size_t>(numel()));
    if (nbytes_) std::memcpy(out.data(), data_, nbytes_);
    return out;
  }

  // The raw 16-bit patterns of a float16 or bfloat16 tensor.
  std::vector<std::uint16_t> as_bits() const {
    if (itemsize(dtype_) != 2) throw std::invalid_argument("as_bits() reads 2-byte dtypes only");
    std::vector<std::uint16_t> out(static_cast<std::size_t>(numel()));
    if (nbytes_) std::memcpy(out.data(), data_, nbytes_);
    return out;
  }

  TensorView view() const { return TensorView{dtype_, shape_, data_, nbytes_}; }

 private:
  DType dtype_;
  std::vector<std::uint64_t> shape_;
  std::shared_ptr<const void> owner_;
  const std::uint8_t* data_;
  std::size_t nbytes_;
};

struct Binary {
  std::vector<std::uint8_t> bytes;
};

struct Entry;

class Value {
 public:
  using Array = std::vector<Value>;
  using Map = std::vector<Entry>;  // str keys, in the order they were written; no duplicates
  using Variant = std::variant<std::monostate, bool, std::int64_t, std::uint64_t, double, std::string, Binary, Array,
                               Map, TensorView, Tensor>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v(b) {}
  Value(int i) : v(static_cast<std::int64_t>(i)) {}
  Value(std::int64_t i) : v(i) {}
  Value(std::uint64_t u) : v(u) {}
  Value(double d) : v(d) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(Binary b) : v(std::move(b)) {}
  Value(Array a) : v(std::move(a)) {}
  Value(Map m) : v(std::move(m)) {}
  Value(TensorView t) : v(std::move(t)) {}
  Value(Tensor t) : v(std::move(t)) {}

  static Value map(std::initializer_list<Entry> entries);

  bool is_nil() const { return std::holds_alternative<std::monostate>(v); }
  bool is_map() const { return std::holds_alternative<Map>(v); }
  bool is_tensor() const { return std::holds_alternative<Tensor>(v); }
  const Map& as_map() const { return get<Map>("a map"); }
  const Array& as_array() const { return get<Array>("an array"); }
  const std::string& as_string() const { return get<std::string>("a string"); }
  const Tensor& tensor() const { return get<Tensor>("a tensor"); }
  bool as_bool() const { return get<bool>("a bool"); }
  double as_double() const;
  std::int64_t as_int() const;

  // The value of ``key`` in a map; nullptr if absent (or not a map).
  const Value* find(std::string_view key) const;
  // The value of ``key`` in a map; std::out_of_range if absent.
  const Value& operator[](std::string_view key) const;

  Variant v;

 private:
  template <class T> const T& get(const char* what) const {
    if (auto* p = std::get_if<T>(&v)) return *p;
    throw std::invalid_argument(std::string("value is not ") + what);
  }
};

struct Entry {
  std::string key;
  Value value;
};

inline Value Value::map(std::initializer_list<Entry> entries) { return Value(Map(entries)); }

inline double Value::as_double() const {
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
  if (auto* u = std::get_if<std::uint64_t>(&v)) return static_cast<double>(*u);
  throw std::invalid_argument("value is not a number");
}

inline std::int64_t Value::as_int() const {
  if (auto* i = std::get_if<std::int64_t>(&v)) return *i;
  if (auto* u = std::get_if<std::uint64_t>(&v); u && *u <= static_cast<std::uint64_t>(INT64_MAX))
    return static_cast<std::int64_t>(*u);
  throw std::invalid_argument("value is not an int64");
}

inline const Value* Value::find(std::string_view key) const {
  if (auto* m = std::get_if<Map>(&v))
    for (const auto& e : *m)
      if (e.key == key) return &e.value;
  return nullptr;
}

inline const Value& Value::operator[](std::string_view key) const {
  if (const Value* found = find(key)) return *found;
  throw std::out_of_range("no key '" + std::string(key) + "' in the value");
}

}  // namespace phyrt
