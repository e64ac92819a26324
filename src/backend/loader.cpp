// Loading the backend modules (modules.hpp), and the core's entry points to
// them: each forwards to the module, or throws UNSUPPORTED saying why the
// backend is not available.
#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "backend/modules.hpp"
#include "comm/mpi/mpi_transport.hpp"
#include "comm/nccl/nccl_comm.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace ep_moe {
namespace backend {

namespace {

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// The directory of the object this code is in (libep_moe.so, or a program
// linked with the internal archive): the modules are installed beside it.
std::string own_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&own_dir), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string f = info.dli_fname;
  const auto slash = f.rfind('/');
  return slash == std::string::npos ? "" : f.substr(0, slash);
}

// dlopen of `file`: from EP_MOE_BACKEND_DIR when set, else beside this
// library, else by the dynamic loader's search. *why gets the loader's
// error of the attempt that found the file (a missing dependency says so),
// or that it was found nowhere.
void* open_module(const char* file, int flags, std::string* why) {
  std::string tried;
  const auto attempt = [&](const std::string& path, bool by_search) -> void* {
    if (!by_search && !exists(path)) {
      tried += (tried.empty() ? "" : ", ") + path;
      return nullptr;
    }
    void* h = dlopen(path.c_str(), flags);
    if (!h) {
      const char* e = dlerror();
      *why = e ? e : "dlopen failed";
    }
    return h;
  };
  if (const char* d = std::getenv("EP_MOE_BACKEND_DIR"); d && *d) {
    if (void* h = attempt(std::string(d) + "/" + file, false)) return h;
    if (!why->empty()) return nullptr;
    *why = std::string(file) + " is not in EP_MOE_BACKEND_DIR (" + d + ")";
    return nullptr;
  }
  const std::string dir = own_dir();
  if (!dir.empty())
    if (void* h = attempt(dir + "/" + file, false)) return h;
  if (!why->empty()) return nullptr;  // it was there and failed to load: that is the reason
  if (void* h = attempt(file, true)) return h;
  *why = std::string(file) + " was found neither beside libep_moe (" + (tried.empty() ? "?" : tried) +
         ") nor by the dynamic loader: " + *why;
  return nullptr;
}

template <class Table>
const Table* load(const char* file, const char* entry, int flags, std::string* why) {
  void* h = open_module(file, flags, why);
  if (!h) return nullptr;
  using Entry = const Table* (*)();
  auto fn = reinterpret_cast<Entry>(dlsym(h, entry));
  const Table* t = fn ? fn() : nullptr;
  if (!t) {
    *why = std::string(file) + " has no " + entry + ": not a module of this ep_moe";
    return nullptr;
  }
  if (t->abi != kModuleAbi || t->version != EP_MOE_VERSION_NUMBER) {
    *why = format("%s is from another build (module ABI %u, version %d; this library: %u, %d)", file, t->abi,
                  t->version, kModuleAbi, EP_MOE_VERSION_NUMBER);
    return nullptr;
  }
  return t;
}

#define EP_MOE_STR2(x) #x
#define EP_MOE_STR(x) EP_MOE_STR2(x)

// A module's table, loaded once: `built` false when this build has no such
// module (`not_built` says so); `what` names the backend in the log.
template <class Table>
const Table* load_once(bool built, const char* file, const char* entry, int flags, const char* what,
                       const char* not_built, std::string* why) {
  struct Slot {
    std::once_flag once;
    const Table* table = nullptr;
    std::string why;
  };
  static Slot s;
  std::call_once(s.once, [&] {
    if (!built) {
      s.why = not_built;
      return;
    }
    s.table = load<Table>(file, entry, flags, &s.why);
    if (s.table) log(EP_MOE_LOG_INFO, "loaded the %s backend (%s)", what, file);
    else log(EP_MOE_LOG_INFO, "no %s backend: %s", what, s.why.c_str());
  });
  if (!s.table && why) *why = s.why;
  return s.table;
}

#if defined(EP_MOE_CUDA_MODULE_BUILT)
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif
#if defined(EP_MOE_MPI_MODULE_BUILT)
constexpr bool kMpiBuilt = true;
#else
constexpr bool kMpiBuilt = false;
#endif
#if defined(EP_MOE_ONEDNN_MODULE_BUILT)
constexpr bool kOnednnBuilt = true;
#else
constexpr bool kOnednnBuilt = false;
#endif

}  // namespace

const CudaModule* cuda_module(std::string* why) {
  return load_once<CudaModule>(kCudaBuilt, kCudaModuleFile, EP_MOE_STR(EP_MOE_CUDA_MODULE_ENTRY), RTLD_NOW | RTLD_LOCAL,
                               "CUDA", "this ep_moe was built without the CUDA toolkit", why);
}

const MpiModule* mpi_module(std::string* why) {
  // Global: Open MPI's own plugins resolve libmpi's symbols through it.
  return load_once<MpiModule>(kMpiBuilt, kMpiModuleFile, EP_MOE_STR(EP_MOE_MPI_MODULE_ENTRY), RTLD_NOW | RTLD_GLOBAL,
                              "MPI", "this ep_moe was built without MPI (install libopenmpi-dev and rebuild)", why);
}

const OnednnModule* onednn_module(std::string* why) {
  // Local: nothing of oneDNN's or its OpenMP runtime's is offered to the host.
  return load_once<OnednnModule>(kOnednnBuilt, kOnednnModuleFile, EP_MOE_STR(EP_MOE_ONEDNN_MODULE_ENTRY),
                                 RTLD_NOW | RTLD_LOCAL, "oneDNN",
                                 "this ep_moe was built without oneDNN (install libdnnl-dev and rebuild)", why);
}

}  // namespace backend

// --- the core's entry points (declared in the backends' headers) -----------

namespace {
const backend::CudaModule& cuda_or_fail(const char* what, bool need_nccl) {
  std::string why;
  const backend::CudaModule* m = backend::cuda_module(&why);
  if (!m) fail(EP_MOE_ERR_UNSUPPORTED, "%s: the CUDA backend is not available: %s", what, why.c_str());
  if (need_nccl && !m->nccl)
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: this ep_moe's CUDA backend was built without NCCL", what);
  return *m;
}
}  // namespace

namespace cuda {
std::unique_ptr<DeviceLayer> create_device_layer(const DeviceLayerDesc& d) {
  const backend::CudaModule& m = cuda_or_fail(format("device %d", d.device).c_str(), false);
  return m.create_device_layer(d);
}
}  // namespace cuda

std::unique_ptr<Comm> make_nccl_comm(void* nccl_comm, int timeout_ms) {
  return cuda_or_fail("an NCCL communicator", true).make_nccl_comm(nccl_comm, timeout_ms);
}
std::unique_ptr<Comm> make_nccl_comm_from_id(const void* id, size_t id_size, int rank, int size, int timeout_ms) {
  return cuda_or_fail("an NCCL communicator", true).make_nccl_comm_from_id(id, id_size, rank, size, timeout_ms);
}
void nccl_unique_id(void* out, size_t out_size) {
  cuda_or_fail("an NCCL unique id", true).nccl_unique_id(out, out_size);
}

std::unique_ptr<Transport> make_mpi_transport(const void* mpi_comm, size_t comm_size) {
  std::string why;
  const backend::MpiModule* m = backend::mpi_module(&why);
  if (!m) fail(EP_MOE_ERR_UNSUPPORTED, "an MPI communicator: the MPI backend is not available: %s", why.c_str());
  return m->make_mpi_transport(mpi_comm, comm_size);
}

namespace cpu {
std::unique_ptr<MatrixEngine> make_matrix_engine(const MatrixEngineDesc& d, std::string* why) {
  const backend::OnednnModule* m = backend::onednn_module(why);
  if (!m) return nullptr;
  try {
    return m->create_matrix_engine(d);
  } catch (const Error& e) {
    if (why) *why = e.what();
    return nullptr;
  }
}
bool matrix_engine_available() { return backend::onednn_module(nullptr) != nullptr; }
}  // namespace cpu

}  // namespace ep_moe
