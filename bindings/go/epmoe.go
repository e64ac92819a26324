// Package epmoe is the Go binding of ep_moe, an expert-parallel
// Mixture-of-Experts layer with a stable C API.
//
// Handles (ExpertMap, Comm, Layer, Checkpoint) are freed by Close(); a
// finalizer is only a backstop. Errors are *Error values carrying the C
// status and message; errors.Is(err, epmoe.ErrInvalidArgument) matches the
// status. Tensors are slices whose lengths are checked against the shapes.
//
// Threading follows the C API: an ExpertMap or Checkpoint may be queried
// from several goroutines; a Comm or Layer must be driven by one goroutine at
// a time (one per rank), except Comm.Abort, which may be called from anywhere.
package epmoe

/*
#cgo pkg-config: ep_moe
#include <stdlib.h>
#include <ep_moe/ep_moe.h>

// cgo forbids Go memory that holds Go pointers from being passed to C, and
// Go pointers from being stored in C memory. These helpers take the Go
// buffers as direct arguments and build the structs that point to them on
// the C stack, for the duration of the call only.
static ep_moe_status_t epmoe_map_create(ep_moe_expert_map_t** out, ep_moe_expert_map_config_t cfg,
                                        const int32_t* slots, int32_t num_slots, const int32_t* per_rank) {
  cfg.custom_slots = slots;
  cfg.num_custom_slots = num_slots;
  cfg.custom_slots_per_rank = per_rank;
  return ep_moe_expert_map_create(out, &cfg);
}

static ep_moe_status_t epmoe_rebalance(int32_t* out, size_t out_len, double* imbalance, const double* load,
                                       size_t load_len, ep_moe_rebalance_config_t cfg, const int32_t* current) {
  cfg.current_slots = current;
  return ep_moe_rebalance(out, out_len, imbalance, load, load_len, &cfg);
}

static ep_moe_status_t epmoe_forward(ep_moe_layer_t* layer, int64_t tokens, const void* hidden,
                                     const void* logits, void* out) {
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = tokens;
  a.hidden = hidden;
  a.router_logits = logits;
  a.out = out;
  return ep_moe_layer_forward(layer, &a);
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"strings"
	"unsafe"
)

// Status is a C status code (EP_MOE_*).
type Status int32

// The statuses of the C API.
const (
	StatusOK              Status = C.EP_MOE_OK
	StatusInvalidArgument Status = C.EP_MOE_ERR_INVALID_ARGUMENT
	StatusOutOfMemory     Status = C.EP_MOE_ERR_OUT_OF_MEMORY
	StatusUnsupported     Status = C.EP_MOE_ERR_UNSUPPORTED
	StatusBufferTooSmall  Status = C.EP_MOE_ERR_BUFFER_TOO_SMALL
	StatusStructSize      Status = C.EP_MOE_ERR_STRUCT_SIZE
	StatusInvalidHandle   Status = C.EP_MOE_ERR_INVALID_HANDLE
	StatusInternal        Status = C.EP_MOE_ERR_INTERNAL
	StatusTimeout         Status = C.EP_MOE_ERR_TIMEOUT
	StatusAborted         Status = C.EP_MOE_ERR_ABORTED
	StatusRemote          Status = C.EP_MOE_ERR_REMOTE
	StatusIO              Status = C.EP_MOE_ERR_IO
	StatusFormat          Status = C.EP_MOE_ERR_FORMAT
	StatusNotFound        Status = C.EP_MOE_ERR_NOT_FOUND
	StatusState           Status = C.EP_MOE_ERR_STATE
	StatusDevice          Status = C.EP_MOE_ERR_DEVICE
)

func (s Status) String() string { return C.GoString(C.ep_moe_status_string(C.ep_moe_status_t(s))) }

// Error is a failed call: its status and the library's message.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("ep_moe: %s: %s", e.Status, e.Message) }

// Is makes errors.Is(err, ErrTimeout) and the like match by status.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Message == "" && t.Status == e.Status
}

// Sentinels for errors.Is.
var (
	ErrInvalidArgument = &Error{Status: StatusInvalidArgument}
	ErrUnsupported     = &Error{Status: StatusUnsupported}
	ErrInvalidHandle   = &Error{Status: StatusInvalidHandle}
	ErrTimeout         = &Error{Status: StatusTimeout}
	ErrAborted         = &Error{Status: StatusAborted}
	ErrRemote          = &Error{Status: StatusRemote}
	ErrIO              = &Error{Status: StatusIO}
	ErrFormat          = &Error{Status: StatusFormat}
	ErrNotFound        = &Error{Status: StatusNotFound}
	ErrState           = &Error{Status: StatusState}
)

func check(s C.ep_moe_status_t, msg func() string) error {
	if s == C.EP_MOE_OK {
		return nil
	}
	return &Error{Status: Status(s), Message: msg()}
}

// threadCall runs a C call whose error message is kept per OS thread
// (ep_moe_last_error) and reads that message on the same thread: without
// the lock the goroutine may move to another thread between the two cgo
// calls and read that thread's (empty) message.
func threadCall(call func() C.ep_moe_status_t) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return check(call(), func() string { return C.GoString(C.ep_moe_last_error()) })
}

func invalid(format string, a ...interface{}) error {
	return &Error{Status: StatusInvalidArgument, Message: fmt.Sprintf(format, a...)}
}

// Version returns the loaded library's version.
func Version() (major, minor, patch int) {
	v := int(C.ep_moe_version())
	return v / 10000, (v / 100) % 100, v % 100
}

// Feature bits for HasFeature.
const (
	FeatureCPU       = uint32(C.EP_MOE_FEATURE_CPU)
	FeatureCUDA      = uint32(C.EP_MOE_FEATURE_CUDA)
	FeatureNCCL      = uint32(C.EP_MOE_FEATURE_NCCL)
	FeatureMPI       = uint32(C.EP_MOE_FEATURE_MPI)
	FeatureCallbacks = uint32(C.EP_MOE_FEATURE_CALLBACKS)
	FeatureOneDNN    = uint32(C.EP_MOE_FEATURE_ONEDNN)
)

// HasFeature reports whether the library was built with every feature in mask.
func HasFeature(mask uint32) bool { return C.ep_moe_has_feature(C.uint32_t(mask)) == 1 }

// ------------------------------------------------------------ expert map --

// ExpertMapConfig selects a placement (see ep_moe_expert_map_config_t).
type ExpertMapConfig struct {
	EPSize, EPRank, Experts int32
	Placement               int32 // PlacementLinear (default), PlacementRoundRobin, PlacementCustom
	FusedShared             int32
	ExpertGroups            int32
	Redundant               int32
	CustomSlots             []int32 // with PlacementCustom
	CustomSlotsPerRank      []int32 // optional
}

// Placements.
const (
	PlacementLinear     = int32(C.EP_MOE_PLACEMENT_LINEAR)
	PlacementRoundRobin = int32(C.EP_MOE_PLACEMENT_ROUND_ROBIN)
	PlacementCustom     = int32(C.EP_MOE_PLACEMENT_CUSTOM)
)

// Map tables (see ep_moe_map_table_t).
const (
	TableExpertMap     = C.EP_MOE_MAP_TABLE_EXPERT_MAP
	TableExpertMask    = C.EP_MOE_MAP_TABLE_EXPERT_MASK
	TableLocalToGlobal = C.EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL
	TableGlobalToPhys  = C.EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL
	TablePhysToGlobal  = C.EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL
)

// ExpertMap is one rank's expert map.
type ExpertMap struct{ p *C.ep_moe_expert_map_t }

// NewExpertMap creates the map of one rank.
func NewExpertMap(cfg ExpertMapConfig) (*ExpertMap, error) {
	var c C.ep_moe_expert_map_config_t
	C.ep_moe_expert_map_config_init(&c)
	c.ep_size = C.int32_t(cfg.EPSize)
	c.ep_rank = C.int32_t(cfg.EPRank)
	c.global_num_experts = C.int32_t(cfg.Experts)
	c.placement = C.int32_t(cfg.Placement)
	c.num_fused_shared_experts = C.int32_t(cfg.FusedShared)
	c.num_expert_group = C.int32_t(cfg.ExpertGroups)
	c.num_redundant_experts = C.int32_t(cfg.Redundant)
	// C reads EPSize entries of CustomSlotsPerRank.
	if len(cfg.CustomSlotsPerRank) > 0 && int64(len(cfg.CustomSlotsPerRank)) != int64(cfg.EPSize) {
		return nil, invalid("CustomSlotsPerRank has %d entries, not EPSize = %d", len(cfg.CustomSlotsPerRank), cfg.EPSize)
	}
	if len(cfg.CustomSlots) > math.MaxInt32 {
		return nil, invalid("%d custom slots is more than an int32 counts", len(cfg.CustomSlots))
	}
	// The slot tables are copied by C into its own memory during the call.
	var slots, perRank *C.int32_t
	if len(cfg.CustomSlots) > 0 {
		slots = (*C.int32_t)(unsafe.Pointer(&cfg.CustomSlots[0]))
	}
	if len(cfg.CustomSlotsPerRank) > 0 {
		perRank = (*C.int32_t)(unsafe.Pointer(&cfg.CustomSlotsPerRank[0]))
	}
	var p *C.ep_moe_expert_map_t
	err := threadCall(func() C.ep_moe_status_t {
		return C.epmoe_map_create(&p, c, slots, C.int32_t(len(cfg.CustomSlots)), perRank)
	})
	runtime.KeepAlive(cfg.CustomSlots)
	runtime.KeepAlive(cfg.CustomSlotsPerRank)
	if err != nil {
		return nil, err
	}
	m := &ExpertMap{p: p}
	runtime.SetFinalizer(m, (*ExpertMap).Close)
	return m, nil
}

// Close frees the map; it may be called more than once.
func (m *ExpertMap) Close() {
	if m.p != nil {
		C.ep_moe_expert_map_destroy(m.p)
		m.p = nil
		runtime.SetFinalizer(m, nil)
	}
}

func (m *ExpertMap) lastError() string { return C.GoString(C.ep_moe_expert_map_last_error(m.p)) }

// LocalExperts returns how many routed experts this rank holds.
func (m *ExpertMap) LocalExperts() (int32, error) {
	var v C.int32_t
	err := check(C.ep_moe_expert_map_get_attr(&v, m.p, C.EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED), m.lastError)
	runtime.KeepAlive(m)
	return int32(v), err
}

// GlobalToLocal returns this rank's local id of a global expert, or -1.
func (m *ExpertMap) GlobalToLocal(global int32) (int32, error) {
	var v C.int32_t
	err := check(C.ep_moe_expert_map_global_to_local(&v, m.p, C.int32_t(global)), m.lastError)
	runtime.KeepAlive(m)
	return int32(v), err
}

// Table copies one of the map's tables.
func (m *ExpertMap) Table(t C.ep_moe_map_table_t) ([]int32, error) {
	var n C.size_t
	if err := check(C.ep_moe_expert_map_table_length(&n, m.p, t), m.lastError); err != nil {
		return nil, err
	}
	out := make([]int32, int(n))
	var ptr *C.int32_t
	if n > 0 {
		ptr = (*C.int32_t)(unsafe.Pointer(&out[0]))
	}
	err := check(C.ep_moe_expert_map_copy_table(ptr, n, m.p, t), m.lastError)
	runtime.KeepAlive(m)
	return out, err
}

// Describe returns the compressed "local->global" description.
func (m *ExpertMap) Describe() (string, error) {
	var need C.size_t
	if err := check(C.ep_moe_expert_map_describe(nil, 0, &need, m.p), m.lastError); err != nil {
		return "", err
	}
	buf := make([]byte, int(need)+1)
	err := check(C.ep_moe_expert_map_describe((*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), nil, m.p), m.lastError)
	runtime.KeepAlive(m)
	return string(buf[:need]), err
}

// ------------------------------------------------------------ comm -------

// Comm is one rank's communicator handle.
type Comm struct{ p *C.ep_moe_comm_t }

// LocalGroup creates size in-process ranks; element i is rank i.
func LocalGroup(size int32, timeoutMs int32) ([]*Comm, error) {
	if size < 1 {
		return nil, invalid("size must be >= 1, got %d", size)
	}
	var cfg C.ep_moe_comm_config_t
	C.ep_moe_comm_config_init(&cfg)
	cfg.timeout_ms = C.int32_t(timeoutMs)
	raw := (*[1 << 16]*C.ep_moe_comm_t)(C.malloc(C.size_t(size) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(raw))
	if err := threadCall(func() C.ep_moe_status_t {
		return C.ep_moe_comm_create_local(&raw[0], C.int32_t(size), &cfg)
	}); err != nil {
		return nil, err
	}
	out := make([]*Comm, size)
	for i := range out {
		c := &Comm{p: raw[i]}
		runtime.SetFinalizer(c, (*Comm).Close)
		out[i] = c
	}
	return out, nil
}

// Close frees the handle.
func (c *Comm) Close() {
	if c.p != nil {
		C.ep_moe_comm_destroy(c.p)
		c.p = nil
		runtime.SetFinalizer(c, nil)
	}
}

func (c *Comm) lastError() string { return C.GoString(C.ep_moe_comm_last_error(c.p)) }

// Rank returns this rank's index.
func (c *Comm) Rank() int32 {
	var v C.int32_t
	C.ep_moe_comm_get_rank(&v, c.p)
	runtime.KeepAlive(c)
	return int32(v)
}

// AllReduce sums data over all ranks, in place.
func (c *Comm) AllReduce(data []float32) error {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	err := check(C.ep_moe_comm_all_reduce(p, p, C.size_t(len(data)), C.EP_MOE_DTYPE_F32, c.p, nil), c.lastError)
	runtime.KeepAlive(data)
	runtime.KeepAlive(c)
	return err
}

// Barrier returns when every rank has called it.
func (c *Comm) Barrier() error {
	err := check(C.ep_moe_comm_barrier(c.p), c.lastError)
	runtime.KeepAlive(c)
	return err
}

// Abort makes blocked and later calls on the group fail; it may be called
// from any goroutine, also while another is blocked on c.
func (c *Comm) Abort() {
	C.ep_moe_comm_abort(c.p)
	runtime.KeepAlive(c)
}

// ------------------------------------------------------------ layer ------

// LayerConfig mirrors ep_moe_layer_config_t; zero values keep the library's
// defaults (f32 dtypes, SiLU, softmax, renormalised top-k, no groups, scale 1).
type LayerConfig struct {
	Hidden, Intermediate, Experts, TopK int32
	SharedIntermediate                  int32
	MaxTokens                           int32
	Threads                             int32
	WeightDType, ActDType, RouterDType  DType
	DispatchMode                        int32
	SkipMode                            int32
	// Routing and the experts' activation.
	Activation          Activation
	Scoring             Scoring
	NoRenormalize       bool    // the top-k weights are not divided by their sum
	ExpertGroups        int32   // grouped top-k: groups (0 = off)
	TopKGroups          int32   // grouped top-k: groups kept per token
	UseScoreBias        bool    // a score-correction bias (WeightScoreBias) chooses the experts
	RoutedScalingFactor float32 // 0: 1
	SharedExpertGate    bool    // the shared expert is scaled by sigmoid(x . WeightSharedExpertGate)
}

// Activation of the expert FFN (ep_moe_activation_t).
type Activation int32

// Activations.
const (
	ActSiLU      Activation = C.EP_MOE_ACT_SILU
	ActGELU      Activation = C.EP_MOE_ACT_GELU
	ActGELUTanh  Activation = C.EP_MOE_ACT_GELU_TANH
	ActSwiGLUOAI Activation = C.EP_MOE_ACT_SWIGLU_OAI // GPT-OSS's clamped SwiGLU
)

// Scoring turns router logits into expert scores (ep_moe_scoring_t).
type Scoring int32

// Scorings.
const (
	ScoringSoftmax Scoring = C.EP_MOE_SCORING_SOFTMAX
	ScoringSigmoid Scoring = C.EP_MOE_SCORING_SIGMOID
)

func (cfg LayerConfig) toC() C.ep_moe_layer_config_t {
	var c C.ep_moe_layer_config_t
	C.ep_moe_layer_config_init(&c)
	c.hidden_size = C.int32_t(cfg.Hidden)
	c.intermediate_size = C.int32_t(cfg.Intermediate)
	c.num_experts = C.int32_t(cfg.Experts)
	c.top_k = C.int32_t(cfg.TopK)
	c.shared_intermediate_size = C.int32_t(cfg.SharedIntermediate)
	c.weight_dtype = C.int32_t(cfg.WeightDType)
	c.act_dtype = C.int32_t(cfg.ActDType)
	c.router_dtype = C.int32_t(cfg.RouterDType)
	c.dispatch_mode = C.int32_t(cfg.DispatchMode)
	c.skip_mode = C.int32_t(cfg.SkipMode)
	if cfg.MaxTokens > 0 {
		c.max_tokens = C.int32_t(cfg.MaxTokens)
	}
	c.num_threads = C.int32_t(cfg.Threads)
	c.activation = C.int32_t(cfg.Activation)
	c.scoring = C.int32_t(cfg.Scoring)
	if cfg.NoRenormalize {
		c.renormalize = 0
	}
	c.num_expert_group = C.int32_t(cfg.ExpertGroups)
	c.topk_group = C.int32_t(cfg.TopKGroups)
	if cfg.UseScoreBias {
		c.use_score_bias = 1
	}
	if cfg.RoutedScalingFactor != 0 {
		c.routed_scaling_factor = C.float(cfg.RoutedScalingFactor)
	}
	if cfg.SharedExpertGate {
		c.shared_expert_gate = 1
	}
	return c
}

func layerConfigFromC(c *C.ep_moe_layer_config_t) LayerConfig {
	return LayerConfig{
		Hidden: int32(c.hidden_size), Intermediate: int32(c.intermediate_size), Experts: int32(c.num_experts),
		TopK: int32(c.top_k), SharedIntermediate: int32(c.shared_intermediate_size), MaxTokens: int32(c.max_tokens),
		Threads: int32(c.num_threads), WeightDType: DType(c.weight_dtype), ActDType: DType(c.act_dtype),
		RouterDType: DType(c.router_dtype), DispatchMode: int32(c.dispatch_mode), SkipMode: int32(c.skip_mode),
		Activation: Activation(c.activation), Scoring: Scoring(c.scoring), NoRenormalize: c.renormalize == 0,
		ExpertGroups: int32(c.num_expert_group), TopKGroups: int32(c.topk_group), UseScoreBias: c.use_score_bias != 0,
		RoutedScalingFactor: float32(c.routed_scaling_factor), SharedExpertGate: c.shared_expert_gate != 0,
	}
}

// MapConfig is the expert map config a layer of this configuration needs on
// rank epRank of epSize (linear placement; set the other fields after).
func (cfg LayerConfig) MapConfig(epSize, epRank int32) ExpertMapConfig {
	return ExpertMapConfig{EPSize: epSize, EPRank: epRank, Experts: cfg.Experts, ExpertGroups: cfg.ExpertGroups}
}

// DType is an element type.
type DType int32

// Element types; Q8_0 .. FP8_E4M3 are block formats (SetWeightBlocks).
const (
	F32     DType = C.EP_MOE_DTYPE_F32
	BF16    DType = C.EP_MOE_DTYPE_BF16
	F16     DType = C.EP_MOE_DTYPE_F16
	Q8_0    DType = C.EP_MOE_DTYPE_Q8_0
	Q4_0    DType = C.EP_MOE_DTYPE_Q4_0
	Q4_K    DType = C.EP_MOE_DTYPE_Q4_K
	Q5_K    DType = C.EP_MOE_DTYPE_Q5_K
	Q6_K    DType = C.EP_MOE_DTYPE_Q6_K
	IQ4_XS  DType = C.EP_MOE_DTYPE_IQ4_XS
	MXFP4   DType = C.EP_MOE_DTYPE_MXFP4
	Q2_K    DType = C.EP_MOE_DTYPE_Q2_K
	Q3_K    DType = C.EP_MOE_DTYPE_Q3_K
	Q4_1    DType = C.EP_MOE_DTYPE_Q4_1
	Q5_0    DType = C.EP_MOE_DTYPE_Q5_0
	Q5_1    DType = C.EP_MOE_DTYPE_Q5_1
	IQ4_NL  DType = C.EP_MOE_DTYPE_IQ4_NL
	IQ2_XXS DType = C.EP_MOE_DTYPE_IQ2_XXS
	IQ2_XS  DType = C.EP_MOE_DTYPE_IQ2_XS
	IQ2_S   DType = C.EP_MOE_DTYPE_IQ2_S
	IQ3_XXS DType = C.EP_MOE_DTYPE_IQ3_XXS
	IQ3_S   DType = C.EP_MOE_DTYPE_IQ3_S
	IQ1_S   DType = C.EP_MOE_DTYPE_IQ1_S
	IQ1_M   DType = C.EP_MOE_DTYPE_IQ1_M
	// FP8_E4M3 is ep_moe's block-scaled FP8 (an f32 scale and 128 E4M3
	// codes a block; C.ep_moe_fp8_pack builds it from weight_scale_inv).
	FP8_E4M3 DType = C.EP_MOE_DTYPE_FP8_E4M3
)

func (d DType) String() string {
	// The library's own name (ep_moe_dtype_name), upper-cased as GGUF
	// writes the block formats' names.
	if n := C.ep_moe_dtype_name(C.ep_moe_dtype_t(d)); n != nil {
		return strings.ToUpper(C.GoString(n))
	}
	return fmt.Sprintf("DType(%d)", int32(d))
}

// Block returns the elements and bytes of one block of d (1 element of its
// size for the plain types; ep_moe_dtype_block).
func (d DType) Block() (elems, bytes int64, err error) {
	var e, b C.int64_t
	if err := threadCall(func() C.ep_moe_status_t { return C.ep_moe_dtype_block(&e, &b, C.ep_moe_dtype_t(d)) }); err != nil {
		return 0, 0, err
	}
	return int64(e), int64(b), nil
}

// Weight selects a tensor for SetWeight.
type Weight int32

// Weights (see ep_moe_weight_t).
const (
	WeightExpertGate       Weight = C.EP_MOE_WEIGHT_EXPERT_GATE
	WeightExpertUp         Weight = C.EP_MOE_WEIGHT_EXPERT_UP
	WeightExpertDown       Weight = C.EP_MOE_WEIGHT_EXPERT_DOWN
	WeightExpertGateUp     Weight = C.EP_MOE_WEIGHT_EXPERT_GATE_UP
	WeightSharedGate       Weight = C.EP_MOE_WEIGHT_SHARED_GATE
	WeightSharedUp         Weight = C.EP_MOE_WEIGHT_SHARED_UP
	WeightSharedDown       Weight = C.EP_MOE_WEIGHT_SHARED_DOWN
	WeightSharedGateUp     Weight = C.EP_MOE_WEIGHT_SHARED_GATE_UP
	WeightSharedExpertGate Weight = C.EP_MOE_WEIGHT_SHARED_EXPERT_GATE
	WeightScoreBias        Weight = C.EP_MOE_WEIGHT_SCORE_BIAS
	WeightRouter           Weight = C.EP_MOE_WEIGHT_ROUTER
	// Biases (GPT-OSS): per routed expert, and the router's.
	WeightExpertGateBias   Weight = C.EP_MOE_WEIGHT_EXPERT_GATE_BIAS
	WeightExpertUpBias     Weight = C.EP_MOE_WEIGHT_EXPERT_UP_BIAS
	WeightExpertDownBias   Weight = C.EP_MOE_WEIGHT_EXPERT_DOWN_BIAS
	WeightExpertGateUpBias Weight = C.EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS
	WeightRouterBias       Weight = C.EP_MOE_WEIGHT_ROUTER_BIAS
)

// Layer is one rank's MoE layer. Its communicator must stay open while the
// layer is used.
type Layer struct {
	p                     *C.ep_moe_layer_t
	hidden, experts, topK int
	actDType, routerDType DType // what Forward's slices must hold (C takes untyped pointers)
	comm                  *Comm // kept reachable for the layer's lifetime
}

// NewLayer creates a layer for this rank; comm may be nil (partial sums).
// dpIsEP passes comm as the DP group too (every rank its own DP replica).
func NewLayer(cfg LayerConfig, m *ExpertMap, comm *Comm, dpIsEP bool) (*Layer, error) {
	c := cfg.toC()
	var ep, dp *C.ep_moe_comm_t
	if comm != nil {
		ep = comm.p
		if dpIsEP {
			dp = comm.p
		}
	}
	var p *C.ep_moe_layer_t
	err := threadCall(func() C.ep_moe_status_t { return C.ep_moe_layer_create(&p, &c, m.p, ep, dp) })
	runtime.KeepAlive(m)
	if err != nil {
		return nil, err
	}
	l := &Layer{p: p, hidden: int(cfg.Hidden), experts: int(cfg.Experts), topK: int(cfg.TopK),
		actDType: cfg.ActDType, routerDType: cfg.RouterDType, comm: comm}
	runtime.SetFinalizer(l, (*Layer).Close)
	return l, nil
}

// Close frees the layer.
func (l *Layer) Close() {
	if l.p != nil {
		C.ep_moe_layer_destroy(l.p)
		l.p = nil
		runtime.SetFinalizer(l, nil)
	}
}

func (l *Layer) lastError() string { return C.GoString(C.ep_moe_layer_last_error(l.p)) }

func (l *Layer) setWeight(which Weight, expert int32, p unsafe.Pointer, n int, dt DType, rows, cols int64) (bool, error) {
	if rows < 0 || cols < 0 || int64(n) != rows*cols {
		return false, invalid("data has %d elements, not rows * cols = %d", n, rows*cols)
	}
	var stored C.int32_t
	err := check(C.ep_moe_layer_set_weight(&stored, l.p, C.ep_moe_weight_t(which), C.int32_t(expert), p,
		C.ep_moe_dtype_t(dt), C.int64_t(rows), C.int64_t(cols)), l.lastError)
	runtime.KeepAlive(l)
	return stored != 0, err
}

// SetWeight gives one f32 weight [rows, cols] (converted to the layer's
// weight dtype); it reports whether this rank kept it (false: another
// rank's expert).
func (l *Layer) SetWeight(which Weight, expert int32, data []float32, rows, cols int64) (bool, error) {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	ok, err := l.setWeight(which, expert, p, len(data), F32, rows, cols)
	runtime.KeepAlive(data)
	return ok, err
}

// SetWeightBlocks gives one weight in a GGUF block format dt (Q8_0 ..
// MXFP4): rows x cols / block-elements blocks, row after row. A CPU layer
// keeps routed experts' weights in the format; others are dequantized.
func (l *Layer) SetWeightBlocks(which Weight, expert int32, blocks []byte, dt DType, rows, cols int64) (bool, error) {
	elems, size, err := dt.Block()
	if err != nil {
		return false, err
	}
	if elems == 1 {
		return false, invalid("SetWeightBlocks takes a block format (Q8_0 .. MXFP4), got %v", dt)
	}
	if rows < 0 || cols < 0 || cols%elems != 0 || int64(len(blocks)) != rows*(cols/elems)*size {
		return false, invalid("blocks has %d bytes, not rows * cols / %d * %d for [%d, %d] in %v", len(blocks), elems,
			size, rows, cols, dt)
	}
	var p unsafe.Pointer
	if len(blocks) > 0 {
		p = unsafe.Pointer(&blocks[0])
	}
	var stored C.int32_t
	err = check(C.ep_moe_layer_set_weight(&stored, l.p, C.ep_moe_weight_t(which), C.int32_t(expert), p,
		C.ep_moe_dtype_t(dt), C.int64_t(rows), C.int64_t(cols)), l.lastError)
	runtime.KeepAlive(blocks)
	runtime.KeepAlive(l)
	return stored != 0, err
}

// SetWeight16 gives one weight of 16-bit elements (their bits; dt BF16 or F16).
func (l *Layer) SetWeight16(which Weight, expert int32, data []uint16, dt DType, rows, cols int64) (bool, error) {
	if dt != BF16 && dt != F16 {
		return false, invalid("SetWeight16 takes BF16 or F16 data, got %v", dt)
	}
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	ok, err := l.setWeight(which, expert, p, len(data), dt, rows, cols)
	runtime.KeepAlive(data)
	return ok, err
}

// Load reads this rank's part of MoE layer `layer` of a checkpoint (see
// ep_moe_layer_load).
func (l *Layer) Load(ck *Checkpoint, layer int32) error {
	err := check(C.ep_moe_layer_load(l.p, ck.p, C.int32_t(layer)), l.lastError)
	runtime.KeepAlive(ck)
	runtime.KeepAlive(l)
	return err
}

// Forward runs a layer whose act_dtype is F32 on hidden states [T, H] with
// router logits [T, E] (f32 router_dtype; or nil with the layer's own router
// weight) into out [T, H].
func (l *Layer) Forward(hidden, logits, out []float32) error {
	if l.actDType != F32 {
		return invalid("the layer's act_dtype is %v, not F32: use Forward16 with the 16-bit values", l.actDType)
	}
	var hp, op unsafe.Pointer
	if len(hidden) > 0 {
		hp = unsafe.Pointer(&hidden[0])
	}
	if len(out) > 0 {
		op = unsafe.Pointer(&out[0])
	}
	err := l.forward(hp, len(hidden), logits, op, len(out))
	runtime.KeepAlive(hidden)
	runtime.KeepAlive(out)
	return err
}

// Forward16 runs a layer whose act_dtype is BF16 or F16 on hidden states
// [T, H] of that type (their bits: see ToBF16, ToF16) into out [T, H];
// logits as for Forward.
func (l *Layer) Forward16(hidden []uint16, logits []float32, out []uint16) error {
	if l.actDType != BF16 && l.actDType != F16 {
		return invalid("the layer's act_dtype is %v: Forward16 takes BF16 or F16 values", l.actDType)
	}
	var hp, op unsafe.Pointer
	if len(hidden) > 0 {
		hp = unsafe.Pointer(&hidden[0])
	}
	if len(out) > 0 {
		op = unsafe.Pointer(&out[0])
	}
	err := l.forward(hp, len(hidden), logits, op, len(out))
	runtime.KeepAlive(hidden)
	runtime.KeepAlive(out)
	return err
}

func (l *Layer) forward(hp unsafe.Pointer, nh int, logits []float32, op unsafe.Pointer, no int) error {
	if l.hidden == 0 || nh%l.hidden != 0 {
		return invalid("hidden has %d elements, not a multiple of H = %d", nh, l.hidden)
	}
	t := nh / l.hidden
	if no != nh {
		return invalid("out has %d elements, hidden %d", no, nh)
	}
	if logits != nil && l.routerDType != F32 {
		return invalid("f32 logits given, but the layer's router_dtype is %v", l.routerDType)
	}
	if logits != nil && len(logits) != t*l.experts {
		return invalid("logits have %d elements, not T * E = %d", len(logits), t*l.experts)
	}
	var lp unsafe.Pointer
	if t > 0 && logits != nil {
		lp = unsafe.Pointer(&logits[0])
	}
	if t == 0 {
		hp, op = nil, nil
	}
	err := check(C.epmoe_forward(l.p, C.int64_t(t), hp, lp, op), l.lastError)
	runtime.KeepAlive(logits)
	runtime.KeepAlive(l)
	return err
}

// ToBF16 rounds f32 values to bfloat16 bits (to nearest even).
func ToBF16(dst []uint16, src []float32) {
	for i, v := range src {
		u := math.Float32bits(v)
		if v != v { // NaN stays NaN
			dst[i] = uint16(u>>16) | 0x40
			continue
		}
		dst[i] = uint16((u + 0x7fff + ((u >> 16) & 1)) >> 16)
	}
}

// FromBF16 widens bfloat16 bits to f32.
func FromBF16(dst []float32, src []uint16) {
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// ToF16 rounds f32 values to IEEE half bits (to nearest even; overflow
// gives infinity).
func ToF16(dst []uint16, src []float32) {
	for i, v := range src {
		dst[i] = f32ToF16(v)
	}
}

// FromF16 widens IEEE half bits to f32.
func FromF16(dst []float32, src []uint16) {
	for i, h := range src {
		dst[i] = f16ToF32(h)
	}
}

func f32ToF16(v float32) uint16 {
	u := math.Float32bits(v)
	sign := uint16(u>>16) & 0x8000
	exp := int32(u>>23) & 0xff
	man := u & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15
	if e >= 31 {
		return sign | 0x7c00
	}
	if e <= 0 {
		if e < -10 {
			return sign
		}
		m := man | 0x800000
		shift := uint32(14 - e)
		half := uint32(1) << (shift - 1)
		rem := m & (uint32(1)<<shift - 1)
		h := m >> shift
		if rem > half || (rem == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	rem := man & 0x1fff
	h := uint32(e)<<10 | man>>13
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, up to infinity
	}
	return sign | uint16(h)
}

func f16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal
		return float32(math.Copysign(math.Ldexp(float64(man), -24), float64(math.Float32frombits(sign|0x3f800000))))
	case exp == 31:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | man<<13)
}

// ------------------------------------------------------------ checkpoint --

// Checkpoint is an opened checkpoint (safetensors file or index, or GGUF)
// seen as MoE layers (see ep_moe_checkpoint_open).
type Checkpoint struct{ p *C.ep_moe_checkpoint_t }

// OpenCheckpoint opens a path and validates every header (default naming).
func OpenCheckpoint(path string) (*Checkpoint, error) {
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var p *C.ep_moe_checkpoint_t
	if err := threadCall(func() C.ep_moe_status_t { return C.ep_moe_checkpoint_open(&p, cp, nil) }); err != nil {
		return nil, err
	}
	ck := &Checkpoint{p: p}
	runtime.SetFinalizer(ck, (*Checkpoint).Close)
	return ck, nil
}

// Close closes the checkpoint; it may be called more than once.
func (ck *Checkpoint) Close() {
	if ck.p != nil {
		C.ep_moe_checkpoint_close(ck.p)
		ck.p = nil
		runtime.SetFinalizer(ck, nil)
	}
}

func (ck *Checkpoint) lastError() string { return C.GoString(C.ep_moe_checkpoint_last_error(ck.p)) }

// Architecture is config.json's model_type or GGUF's general.architecture
// ("" when none).
func (ck *Checkpoint) Architecture() string {
	s := C.GoString(C.ep_moe_checkpoint_architecture(ck.p))
	runtime.KeepAlive(ck)
	return s
}

// MoELayers lists the layer indices that hold routed experts.
func (ck *Checkpoint) MoELayers() ([]int32, error) {
	var n C.size_t
	if err := check(C.ep_moe_checkpoint_moe_layers(nil, 0, &n, ck.p), ck.lastError); err != nil {
		return nil, err
	}
	out := make([]int32, int(n))
	if n > 0 {
		if err := check(C.ep_moe_checkpoint_moe_layers((*C.int32_t)(unsafe.Pointer(&out[0])), n, &n, ck.p),
			ck.lastError); err != nil {
			return nil, err
		}
	}
	runtime.KeepAlive(ck)
	return out, nil
}

// LayerConfig derives the configuration of MoE layer `layer` (shapes from
// the tensors, routing and activation from the architecture; see
// ep_moe_checkpoint_layer_config) over `base` (MaxTokens, Threads, dtypes of
// the activations, dispatch are kept).
func (ck *Checkpoint) LayerConfig(base LayerConfig, layer int32) (LayerConfig, error) {
	c := base.toC()
	err := check(C.ep_moe_checkpoint_layer_config(&c, ck.p, C.int32_t(layer)), ck.lastError)
	runtime.KeepAlive(ck)
	if err != nil {
		return LayerConfig{}, err
	}
	return layerConfigFromC(&c), nil
}

// ----------------------------------------------------- load balancing --

// ExpertLoad returns the per-expert load of the window (see
// ep_moe_layer_expert_load); acrossRanks sums over the EP group (every rank
// calls it), reset starts a new window.
func (l *Layer) ExpertLoad(acrossRanks, reset bool) ([]int64, error) {
	out := make([]int64, l.experts)
	var across, rst C.int32_t
	if acrossRanks {
		across = 1
	}
	if reset {
		rst = 1
	}
	err := check(C.ep_moe_layer_expert_load((*C.int64_t)(unsafe.Pointer(&out[0])), C.size_t(len(out)), l.p, across, rst),
		l.lastError)
	runtime.KeepAlive(l)
	return out, err
}

// Replace applies a new placement to the running layer (see
// ep_moe_layer_replace; every rank of the group calls it). comm nil keeps
// the current group; otherwise the layer moves to comm (elastic EP), which
// must then stay open while the layer is used.
func (l *Layer) Replace(m *ExpertMap, comm *Comm) error {
	var c *C.ep_moe_comm_t
	if comm != nil {
		c = comm.p
	}
	err := check(C.ep_moe_layer_replace(l.p, m.p, c, nil, 0), l.lastError)
	if err == nil && comm != nil {
		l.comm = comm
	}
	runtime.KeepAlive(m)
	runtime.KeepAlive(l)
	return err
}

// Rebalance computes a balanced placement from per-expert load (see
// ep_moe_rebalance): the custom slot table and its imbalance (max rank
// load / mean). current (may be nil) is the placement in use: packs then
// stay on the ranks that hold most of them.
func Rebalance(load []float64, slots, ranks, ranksPerNode, groups int32, current []int32) ([]int32, float64, error) {
	if len(load) == 0 || slots <= 0 {
		return nil, 0, invalid("load is empty or slots %d <= 0", slots)
	}
	var c C.ep_moe_rebalance_config_t
	C.ep_moe_rebalance_config_init(&c)
	c.num_experts = C.int32_t(len(load))
	c.num_slots = C.int32_t(slots)
	c.num_ranks = C.int32_t(ranks)
	c.ranks_per_node = C.int32_t(ranksPerNode)
	c.num_expert_groups = C.int32_t(groups)
	c.num_current_slots = C.int32_t(len(current))
	var cur *C.int32_t
	if len(current) > 0 {
		cur = (*C.int32_t)(unsafe.Pointer(&current[0]))
	}
	out := make([]int32, slots)
	var imbalance C.double
	err := threadCall(func() C.ep_moe_status_t {
		return C.epmoe_rebalance((*C.int32_t)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &imbalance,
			(*C.double)(unsafe.Pointer(&load[0])), C.size_t(len(load)), c, cur)
	})
	runtime.KeepAlive(load)
	runtime.KeepAlive(current)
	if err != nil {
		return nil, 0, err
	}
	return out, float64(imbalance), nil
}
