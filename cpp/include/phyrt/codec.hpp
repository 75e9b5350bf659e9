// The wire of docs/protocol.md, protocol version 1: a msgpack header frame, then one raw frame per tensor.
//
//   encode_message(header fields, payload)  -> [header bytes, *tensor frames]   (requests)
//   decode_message(frames)                  -> the header as a Value, tensors resolved (replies)
//
// A tensor in the header is msgpack extension 1, body [dtype, shape, index]: its bytes are tensor
// frame ``index`` (0: the first frame after the header), each frame referenced exactly once.
// Extension 2 (shared memory) is never asked for by this client, and refused if it comes.
// Decoding treats its input as untrusted: anything malformed raises ProtocolError.
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST
#endif

#include <msgpack.hpp>
#include <zmq.hpp>

#include "phyrt/errors.hpp"
#include "phyrt/value.hpp"

namespace phyrt {

inline constexpr int kProtocolVersion = 1;
inline constexpr std::int8_t kExtFrame = 1;
inline constexpr std::int8_t kExtShm = 2;
inline constexpr std::size_t kMaxTensorFrames = 256;
inline constexpr int kMaxDepth = 32;
inline constexpr std::size_t kMaxNdim = 16;
inline constexpr std::uint64_t kMaxDim = std::uint64_t{1} << 40;

namespace detail {

using Packer = msgpack::packer<msgpack::sbuffer>;

inline void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

inline void pack_tensor(Packer& pk, const TensorView& t, std::vector<zmq::message_t>& frames) {
  if (t.shape.size() > kMaxNdim) throw std::invalid_argument("a tensor has at most 16 dimensions");
  for (auto d : t.shape)
    if (d >= kMaxDim) throw std::invalid_argument("tensor shape entries must be below 2**40");
  if (numel(t.shape) * itemsize(t.dtype) != t.nbytes)
    throw std::invalid_argument(std::string("tensor of dtype ") + dtype_name(t.dtype) + " has " +
                                std::to_string(t.nbytes) + " bytes, its shape needs " +
                                std::to_string(numel(t.shape) * itemsize(t.dtype)));
  if (frames.size() >= kMaxTensorFrames) throw std::invalid_argument("a message carries at most 256 tensors");
  msgpack::sbuffer body;
  Packer inner(body);
  inner.pack_array(3);
  pack_str(inner, dtype_name(t.dtype));
  inner.pack_array(static_cast<std::uint32_t>(t.shape.size()));
  for (auto d : t.shape) inner.pack(d);
  inner.pack(static_cast<std::uint64_t>(frames.size()));
  frames.emplace_back(t.data, t.nbytes);  // the one copy of the caller's bytes
  pk.pack_ext(body.size(), kExtFrame);
  pk.pack_ext_body(body.data(), static_cast<std::uint32_t>(body.size()));
}

inline void pack_value(Packer& pk, const Value& value, std::vector<zmq::message_t>& frames, int depth) {
  if (depth > kMaxDepth) throw std::invalid_argument("a value nests deeper than 32 levels");
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::monostate>) pk.pack_nil();
        else if constexpr (std::is_same_v<T, std::string>) pack_str(pk, x);
        else if constexpr (std::is_same_v<T, Binary>) {
          pk.pack_bin(static_cast<std::uint32_t>(x.bytes.size()));
          pk.pack_bin_body(reinterpret_cast<const char*>(x.bytes.data()), static_cast<std::uint32_t>(x.bytes.size()));
        } else if constexpr (std::is_same_v<T, Value::Array>) {
          pk.pack_array(static_cast<std::uint32_t>(x.size()));
          for (const auto& item : x) pack_value(pk, item, frames, depth + 1);
        } else if constexpr (std::is_same_v<T, Value::Map>) {
          pk.pack_map(static_cast<std::uint32_t>(x.size()));
          for (const auto& e : x) {
            pack_str(pk, e.key);
            pack_value(pk, e.value, frames, depth + 1);
          }
        } else if constexpr (std::is_same_v<T, TensorView>) pack_tensor(pk, x, frames);
        else if constexpr (std::is_same_v<T, Tensor>) pack_tensor(pk, x.view(), frames);
        else pk.pack(x);  // bool, int64 (smallest encoding), uint64, double (float 64)
      },
      value.v);
}

}  // namespace detail

// A message: the header map {fields..., [payload_key: payload]} and its tensor frames.
// ``fields`` are written in order; ``payload`` (if given) last, under ``payload_key``.
inline std::vector<zmq::message_t> encode_message(const Value::Map& fields, const Value* payload = nullptr,
                                                  std::string_view payload_key = "payload") {
  std::vector<zmq::message_t> frames;
  msgpack::sbuffer head;
  detail::Packer pk(head);
  pk.pack_map(static_cast<std::uint32_t>(fields.size() + (payload != nullptr)));
  for (const auto& e : fields) {
    detail::pack_str(pk, e.key);
    detail::pack_value(pk, e.value, frames, 1);
  }
  if (payload != nullptr) {
    detail::pack_str(pk, payload_key);
    detail::pack_value(pk, *payload, frames, 1);
  }
  std::vector<zmq::message_t> message;
  message.reserve(frames.size() + 1);
  message.emplace_back(head.data(), head.size());
  for (auto& f : frames) message.push_back(std::move(f));
  return message;
}

namespace detail {

struct Frames {
  std::vector<std::shared_ptr<zmq::message_t>> frames;
  std::vector<bool> used;
};

inline Value to_value(const msgpack::object& o, Frames& fr, int depth);

inline std::uint64_t as_uint(const msgpack::object& o, const char* what) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) throw ProtocolError(std::string(what) + " must be an int >= 0");
  return o.via.u64;
}

inline Tensor frame_tensor(const msgpack::object_ext& ext, Frames& fr) {
  if (ext.type() == kExtShm)
    throw ProtocolError("a shared-memory tensor arrived, but this client registers no shared memory");
  if (ext.type() != kExtFrame) throw ProtocolError("unknown extension type " + std::to_string(ext.type()));
  msgpack::object_handle oh;
  try {
    oh = msgpack::unpack(ext.data(), ext.size);
  } catch (const std::exception& e) {
    throw ProtocolError(std::string("malformed tensor descriptor: ") + e.what());
  }
  const msgpack::object& body = oh.get();
  if (body.type != msgpack::type::ARRAY || body.via.array.size != 3)
    throw ProtocolError("a frame tensor must be [dtype, shape, index]");
  const msgpack::object* item = body.via.array.ptr;
  if (item[0].type != msgpack::type::STR) throw ProtocolError("tensor dtype must be a str");
  auto dtype = dtype_from_name(std::string_view(item[0].via.str.ptr, item[0].via.str.size));
  if (!dtype) throw ProtocolError("tensor dtype is not allowed: " + std::string(item[0].via.str.ptr, item[0].via.str.size));
  if (item[1].type != msgpack::type::ARRAY || item[1].via.array.size > kMaxNdim)
    throw ProtocolError("tensor shape must be a list of at most 16 ints");
  std::vector<std::uint64_t> shape;
  for (std::uint32_t i = 0; i < item[1].via.array.size; ++i) {
    shape.push_back(as_uint(item[1].via.array.ptr[i], "a shape entry"));
    if (shape.back() >= kMaxDim) throw ProtocolError("tensor shape entries must be below 2**40");
  }
  std::uint64_t index = as_uint(item[2], "a tensor frame index");
  if (index >= fr.frames.size()) throw ProtocolError("tensor frame index " + std::to_string(index) + " is out of range");
  if (fr.used[index]) throw ProtocolError("tensor frame " + std::to_string(index) + " is referenced twice");
  fr.used[index] = true;
  const auto& frame = fr.frames[index];
  if (numel(shape) * itemsize(*dtype) != frame->size())
    throw ProtocolError("tensor frame " + std::to_string(index) + " has " + std::to_string(frame->size()) +
                        " bytes; its dtype and shape need " + std::to_string(numel(shape) * itemsize(*dtype)));
  if (*dtype == DType::boolean)
    for (std::size_t i = 0; i < frame->size(); ++i)
      if (frame->data<std::uint8_t>()[i] > 1) throw ProtocolError("a bool tensor holds bytes other than 0 and 1");
  return Tensor(*dtype, std::move(shape), frame, frame->data<std::uint8_t>(), frame->size());
}

inline Value to_value(const msgpack::object& o, Frames& fr, int depth) {
  if (depth > kMaxDepth) throw ProtocolError("nested deeper than 32 levels");
  switch (o.type) {
    case msgpack::type::NIL: return Value();
    case msgpack::type::BOOLEAN: return Value(o.via.boolean);
    case msgpack::type::POSITIVE_INTEGER: return Value(o.via.u64);
    case msgpack::type::NEGATIVE_INTEGER: return Value(o.via.i64);
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return Value(o.via.f64);
    case msgpack::type::STR: return Value(std::string(o.via.str.ptr, o.via.str.size));
    case msgpack::type::BIN: {
      const auto* p = reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr);
      return Value(Binary{std::vector<std::uint8_t>(p, p + o.via.bin.size)});
    }
    case msgpack::type::ARRAY: {
      Value::Array items;
      items.reserve(o.via.array.size);
      for (std::uint32_t i = 0; i < o.via.array.size; ++i) items.push_back(to_value(o.via.array.ptr[i], fr, depth + 1));
      return Value(std::move(items));
    }
    case msgpack::type::MAP: {
      Value::Map entries;
      entries.reserve(o.via.map.size);
      for (std::uint32_t i = 0; i < o.via.map.size; ++i) {
        const auto& kv = o.via.map.ptr[i];
        if (kv.key.type != msgpack::type::STR) throw ProtocolError("map keys must be str");
        std::string key(kv.key.via.str.ptr, kv.key.via.str.size);
        for (const auto& e : entries)
          if (e.key == key) throw ProtocolError("a map has duplicate keys");
        entries.push_back(Entry{std::move(key), to_value(kv.val, fr, depth + 1)});
      }
      return Value(std::move(entries));
    }
    case msgpack::type::EXT: return Value(frame_tensor(o.via.ext, fr));
    default: throw ProtocolError("unknown msgpack type");
  }
}

}  // namespace detail

// A received message (header frame, then tensor frames) as its header map, tensors resolved:
// each result tensor views its frame, which lives as long as any Tensor of it.
inline Value decode_message(std::vector<zmq::message_t>&& message, std::size_t max_header_bytes = 1u << 30) {
  if (message.empty()) throw ProtocolError("an empty message");
  const zmq::message_t& head = message[0];
  if (head.size() > max_header_bytes) throw ProtocolError("header frame exceeds the limit");
  detail::Frames fr;
  for (std::size_t i = 1; i < message.size(); ++i)
    fr.frames.push_back(std::make_shared<zmq::message_t>(std::move(message[i])));
  fr.used.assign(fr.frames.size(), false);
  msgpack::object_handle oh;
  std::size_t offset = 0;
  try {
    oh = msgpack::unpack(head.data<char>(), head.size(), offset);
  } catch (const std::exception& e) {
    throw ProtocolError(std::string("malformed header: ") + e.what());
  }
  if (offset != head.size()) throw ProtocolError("malformed header: trailing bytes");
  if (oh.get().type != msgpack::type::MAP) throw ProtocolError("a header must be a msgpack map");
  Value header = detail::to_value(oh.get(), fr, 0);
  const Value* v = header.find("v");
  if (v == nullptr || !std::holds_alternative<std::uint64_t>(v->v) ||
      std::get<std::uint64_t>(v->v) != static_cast<std::uint64_t>(kProtocolVersion))
    throw ProtocolError("protocol version is not 1, the one this client speaks");
  for (std::size_t i = 0; i < fr.used.size(); ++i)
    if (!fr.used[i]) throw ProtocolError("tensor frame " + std::to_string(i) + " is not referenced by the header");
  return header;
}

}  // namespace phyrt
