// Random-access byte sources the parsers and the loader read from: a file
// (pread, thread-safe) or a memory buffer (tests, fuzzing). Every read is
// bounds-checked and throws ep_moe::Error naming the source.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ep_moe {
namespace io {

// Test hook (internal, not exported): the n-th FileSource::read from now
// (0: the next one) fails with EP_MOE_ERR_IO, as a failing disk would; a
// negative n disarms it. Lets tests fail every read site of open and load.
void inject_read_failure(long n);

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly n bytes at offset; throws FORMAT past the end, IO on a
  // failed read.
  virtual void read(uint64_t offset, void* dst, size_t n) const = 0;
  const std::string& name() const { return name_; }

 protected:
  std::string name_;
};

class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path);  // throws IO naming the path
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* dst, size_t n) const override;

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

class MemorySource final : public ByteSource {
 public:
  MemorySource(const void* data, size_t size, std::string name);  // borrows data
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* dst, size_t n) const override;

 private:
  const uint8_t* data_;
  uint64_t size_;
};

// Sequential little-endian reader over a source with a small buffer, for
// headers: every read checks the bytes that remain.
class Cursor {
 public:
  Cursor(const ByteSource& src, uint64_t pos) : src_(src), pos_(pos) {}
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return src_.size() - pos_; }
  void bytes(void* dst, size_t n);
  void skip(uint64_t n);
  uint8_t u8();
  uint32_t u32();
  uint64_t u64();
  // A length-prefixed string (u64 length); longer than max_len is FORMAT.
  std::string string(uint64_t max_len, const char* what);

 private:
  void fill(size_t need);
  const ByteSource& src_;
  uint64_t pos_;
  std::vector<uint8_t> buf_;
  uint64_t buf_pos_ = 0;  // file offset of buf_[0]
};

// Whether path is a directory, or a regular file (stat: never blocks).
bool is_dir(const std::string& path);
bool is_file(const std::string& path);
// A whole file of at most `cap` bytes (an index, a config.json);
// EP_MOE_ERR_FORMAT naming the file above that, FileSource's errors else.
std::string read_small_file(const std::string& path, uint64_t cap);

}  // namespace io
}  // namespace ep_moe
