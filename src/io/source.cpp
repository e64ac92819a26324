#include "io/source.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <algorithm>
#include <cstring>

#include "common/error.hpp"

namespace ep_moe {
namespace io {

namespace {
std::atomic<long> g_read_fault{-1};
}  // namespace

void inject_read_failure(long n) { g_read_fault.store(n < 0 ? -1 : n, std::memory_order_relaxed); }

FileSource::FileSource(const std::string& path) {
  name_ = path;
  // O_NONBLOCK: opening a FIFO (or a device that waits for a peer) for
  // reading would otherwise block until a writer comes, i.e. forever; it
  // returns at once and the type is checked before any read.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail(EP_MOE_ERR_IO, "%s: cannot open: %s", path.c_str(), std::strerror(errno));
  struct stat st;
  errno = 0;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(EP_MOE_ERR_IO, "%s: not a regular file%s%s", path.c_str(), e ? ": " : "", e ? std::strerror(e) : "");
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<uint64_t>(st.st_size);
}

FileSource::~FileSource() {
  if (fd_ >= 0) ::close(fd_);
}

void FileSource::read(uint64_t offset, void* dst, size_t n) const {
  if (g_read_fault.load(std::memory_order_relaxed) >= 0 && g_read_fault.fetch_sub(1) == 0)
    fail(EP_MOE_ERR_IO, "%s: read failed at offset %llu: injected failure", name_.c_str(),
         static_cast<unsigned long long>(offset));
  if (offset > size_ || n > size_ - offset)
    fail(EP_MOE_ERR_FORMAT, "%s: read of %zu bytes at offset %llu is past the end (%llu bytes)", name_.c_str(), n,
         static_cast<unsigned long long>(offset), static_cast<unsigned long long>(size_));
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(EP_MOE_ERR_IO, "%s: read failed at offset %llu: %s", name_.c_str(), static_cast<unsigned long long>(offset),
           std::strerror(errno));
    }
    if (got == 0)
      fail(EP_MOE_ERR_IO, "%s: the file shrank while reading (offset %llu)", name_.c_str(),
           static_cast<unsigned long long>(offset));
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
}

MemorySource::MemorySource(const void* data, size_t size, std::string name)
    : data_(static_cast<const uint8_t*>(data)), size_(size) {
  name_ = std::move(name);
}

void MemorySource::read(uint64_t offset, void* dst, size_t n) const {
  if (offset > size_ || n > size_ - offset)
    fail(EP_MOE_ERR_FORMAT, "%s: read of %zu bytes at offset %llu is past the end (%llu bytes)", name_.c_str(), n,
         static_cast<unsigned long long>(offset), static_cast<unsigned long long>(size_));
  if (n) std::memcpy(dst, data_ + offset, n);
}

void Cursor::fill(size_t need) {
  if (need > remaining())
    fail(EP_MOE_ERR_FORMAT, "%s: truncated: %zu bytes needed at offset %llu, %llu remain", src_.name().c_str(), need,
         static_cast<unsigned long long>(pos_), static_cast<unsigned long long>(remaining()));
}

void Cursor::bytes(void* dst, size_t n) {
  fill(n);
  // Serve from the buffer when possible; refill with up to 64 KiB.
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    if (pos_ >= buf_pos_ && pos_ < buf_pos_ + buf_.size()) {
      const size_t off = static_cast<size_t>(pos_ - buf_pos_);
      const size_t take = std::min(n, buf_.size() - off);
      std::memcpy(out, buf_.data() + off, take);
      out += take;
      n -= take;
      pos_ += take;
      continue;
    }
    if (n >= 65536) {  // large reads bypass the buffer
      src_.read(pos_, out, n);
      pos_ += n;
      return;
    }
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(65536, remaining()));
    buf_.resize(chunk);
    src_.read(pos_, buf_.data(), chunk);
    buf_pos_ = pos_;
  }
}

void Cursor::skip(uint64_t n) {
  if (n > remaining())
    fail(EP_MOE_ERR_FORMAT, "%s: truncated: %llu bytes to skip at offset %llu, %llu remain", src_.name().c_str(),
         static_cast<unsigned long long>(n), static_cast<unsigned long long>(pos_),
         static_cast<unsigned long long>(remaining()));
  pos_ += n;
}

uint8_t Cursor::u8() {
  uint8_t v;
  bytes(&v, 1);
  return v;
}
uint32_t Cursor::u32() {
  uint8_t b[4];
  bytes(b, 4);
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
         static_cast<uint32_t>(b[3]) << 24;
}
uint64_t Cursor::u64() {
  const uint64_t lo = u32();
  const uint64_t hi = u32();
  return lo | hi << 32;
}

std::string Cursor::string(uint64_t max_len, const char* what) {
  const uint64_t at = pos_;
  const uint64_t n = u64();
  if (n > max_len || n > remaining())
    fail(EP_MOE_ERR_FORMAT, "%s: %s at offset %llu claims %llu bytes (limit %llu, %llu remain)", src_.name().c_str(),
         what, static_cast<unsigned long long>(at), static_cast<unsigned long long>(n),
         static_cast<unsigned long long>(max_len), static_cast<unsigned long long>(remaining()));
  std::string s(static_cast<size_t>(n), '\0');
  bytes(&s[0], static_cast<size_t>(n));
  return s;
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string read_small_file(const std::string& path, uint64_t cap) {
  FileSource f(path);
  if (f.size() > cap)
    fail(EP_MOE_ERR_FORMAT, "%s: %llu bytes is above the %llu-byte limit for this file", path.c_str(),
         static_cast<unsigned long long>(f.size()), static_cast<unsigned long long>(cap));
  std::string s(static_cast<size_t>(f.size()), '\0');
  f.read(0, &s[0], s.size());
  return s;
}

}  // namespace io
}  // namespace ep_moe
