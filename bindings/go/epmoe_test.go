package epmoe

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

const (
	hSize, iSize, eCount, kTop, tTokens = 16, 8, 6, 2, 5
)

func value(a, b, m int) float32 { return 0.02 * float32((a*7+b*3)%m-m/2) }

func TestExpertMapQuery(t *testing.T) {
	m, err := NewExpertMap(ExpertMapConfig{EPSize: 4, EPRank: 1, Experts: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if d, _ := m.Describe(); d != "0->3, 1->4, 2->5" {
		t.Fatalf("describe: %q", d)
	}
	if l, _ := m.GlobalToLocal(4); l != 1 {
		t.Fatalf("global 4 -> local %d", l)
	}
	if n, _ := m.LocalExperts(); n != 3 {
		t.Fatalf("local experts %d", n)
	}
	tab, err := m.Table(TableLocalToGlobal)
	if err != nil || len(tab) != 3 || tab[0] != 3 || tab[2] != 5 {
		t.Fatalf("table %v %v", tab, err)
	}
	if !HasFeature(FeatureCPU) {
		t.Fatal("no CPU feature")
	}
}

// runRank runs rank r of ep (comm may be nil for a single rank).
func runRank(t *testing.T, ep, r int32, comm *Comm) []float32 {
	l := makeLayer(t, ep, r, comm)
	if l == nil {
		return nil
	}
	defer l.Close()
	return forward(t, l)
}

// expertWeights gives expert e's fixed gate, up and down weights.
func expertWeights(e int) (g, u, d []float32) {
	g, u, d = make([]float32, iSize*hSize), make([]float32, iSize*hSize), make([]float32, hSize*iSize)
	for i := range g {
		g[i], u[i], d[i] = value(e, i, 11), value(e+1, i, 13), value(e+2, i, 9)
	}
	return g, u, d
}

// makeLayer creates rank r's layer with every weight set.
func makeLayer(t *testing.T, ep, r int32, comm *Comm) *Layer {
	m, err := NewExpertMap(ExpertMapConfig{EPSize: ep, EPRank: r, Experts: eCount})
	if err != nil {
		t.Error(err)
		return nil
	}
	defer m.Close()
	l, err := NewLayer(LayerConfig{Hidden: hSize, Intermediate: iSize, Experts: eCount, TopK: kTop, MaxTokens: tTokens, Threads: 1}, m, comm, false)
	if err != nil {
		t.Error(err)
		return nil
	}
	for e := 0; e < eCount; e++ {
		g, u, d := expertWeights(e)
		for _, w := range []struct {
			which      Weight
			v          []float32
			rows, cols int64
		}{{WeightExpertGate, g, iSize, hSize}, {WeightExpertUp, u, iSize, hSize}, {WeightExpertDown, d, hSize, iSize}} {
			if _, err := l.SetWeight(w.which, int32(e), w.v, w.rows, w.cols); err != nil {
				t.Error(err)
				l.Close()
				return nil
			}
		}
	}
	return l
}

// forward runs the layer on fixed inputs.
func forward(t *testing.T, l *Layer) []float32 {
	x := make([]float32, tTokens*hSize)
	logits := make([]float32, tTokens*eCount)
	for i := range x {
		x[i] = value(i, 1, 17)
	}
	for i := range logits {
		logits[i] = 10 * value(i, 5, 23)
	}
	out := make([]float32, len(x))
	if err := l.Forward(x, logits, out); err != nil {
		t.Error(err)
		return nil
	}
	return out
}

func TestTwoRankForwardMatchesOneRank(t *testing.T) {
	comms, err := LocalGroup(2, 30000)
	if err != nil {
		t.Fatal(err)
	}
	outs := make([][]float32, 2)
	var wg sync.WaitGroup
	for r := 0; r < 2; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			outs[r] = runRank(t, 2, int32(r), comms[r])
		}(r)
	}
	wg.Wait()
	for _, c := range comms {
		c.Close()
	}
	one := runRank(t, 1, 0, nil)
	if outs[0] == nil || outs[1] == nil || one == nil {
		t.Fatal("a rank failed")
	}
	nonzero := false
	for i := range one {
		diff := outs[0][i] - one[i]
		if diff < -1e-5 || diff > 1e-5 || outs[0][i] != outs[1][i] {
			t.Fatalf("element %d: ranks %v %v, one rank %v", i, outs[0][i], outs[1][i], one[i])
		}
		nonzero = nonzero || one[i] != 0
	}
	if !nonzero {
		t.Fatal("all-zero output")
	}
}

func TestBadArgumentsAreErrorsWithTheMessage(t *testing.T) {
	_, err := NewExpertMap(ExpertMapConfig{EPSize: 4, EPRank: 4, Experts: 8})
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "ep_rank") {
		t.Fatalf("got %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Status != StatusInvalidArgument {
		t.Fatalf("not an *Error: %v", err)
	}
	m, _ := NewExpertMap(ExpertMapConfig{EPSize: 1, Experts: eCount})
	defer m.Close()
	l, err := NewLayer(LayerConfig{Hidden: hSize, Intermediate: iSize, Experts: eCount, TopK: kTop}, m, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	w := make([]float32, iSize*hSize)
	if _, err := l.SetWeight(WeightExpertDown, 0, w, iSize, hSize); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "must be [16, 8], got [8, 16]") {
		t.Fatalf("got %v", err)
	}
	x := make([]float32, hSize)
	if err := l.Forward(x, make([]float32, eCount), make([]float32, hSize)); !errors.Is(err, ErrState) {
		t.Fatalf("got %v", err)
	}
}

func TestAbortEndsABlockedCollective(t *testing.T) {
	comms, err := LocalGroup(2, 30000)
	if err != nil {
		t.Fatal(err)
	}
	defer comms[0].Close()
	defer comms[1].Close()
	done := make(chan error)
	go func() { done <- comms[0].Barrier() }() // rank 1 never joins
	comms[0].Abort()
	if err := <-done; !errors.Is(err, ErrAborted) {
		t.Fatalf("got %v", err)
	}
	v := []float32{1}
	if err := comms[1].AllReduce(v); !errors.Is(err, ErrAborted) {
		t.Fatalf("got %v", err)
	}
}

func TestLoadRebalanceReplace(t *testing.T) {
	comms, err := LocalGroup(2, 30000)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range comms {
			c.Close()
		}
	}()
	before, after := make([][]float32, 2), make([][]float32, 2)
	loads := make([][]int64, 2)
	var wg sync.WaitGroup
	for r := 0; r < 2; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			l := makeLayer(t, 2, int32(r), comms[r])
			if l == nil {
				return
			}
			defer l.Close()
			before[r] = forward(t, l)
			load, err := l.ExpertLoad(true, true)
			if err != nil {
				t.Error(err)
				return
			}
			loads[r] = load
			w := make([]float64, len(load))
			for i, v := range load {
				w[i] = float64(v)
			}
			slots, imbalance, err := Rebalance(w, 8, 2, 0, 0, nil)
			if err != nil || imbalance < 1 {
				t.Error(err, imbalance)
				return
			}
			m, err := NewExpertMap(ExpertMapConfig{EPSize: 2, EPRank: int32(r), Experts: eCount, Placement: PlacementCustom, CustomSlots: slots})
			if err != nil {
				t.Error(err)
				return
			}
			defer m.Close()
			if err := l.Replace(m, nil); err != nil {
				t.Error(err)
				return
			}
			after[r] = forward(t, l)
		}(r)
	}
	wg.Wait()
	if after[0] == nil || after[1] == nil {
		t.Fatal("a rank failed")
	}
	var total int64
	for _, v := range loads[0] {
		total += v
	}
	if total != tTokens*kTop {
		t.Fatalf("load %v sums to %d, want %d", loads[0], total, tTokens*kTop)
	}
	for r := 0; r < 2; r++ {
		for i := range before[r] {
			if d := before[r][i] - after[r][i]; d < -1e-5 || d > 1e-5 {
				t.Fatalf("rank %d element %d: %v before, %v after", r, i, before[r][i], after[r][i])
			}
		}
	}
	if _, _, err := Rebalance([]float64{1, 2}, 3, 2, 0, 0, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad slots: %v", err)
	}
}

// The thread-local error message must be read on the thread that made the
// failing call, however the goroutines are scheduled.
func TestThreadErrorMessageUnderConcurrency(t *testing.T) {
	var wg sync.WaitGroup
	failures := make(chan error, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 300; i++ {
				_, err := NewExpertMap(ExpertMapConfig{EPSize: 4, EPRank: int32(4 + g), Experts: 8})
				if err == nil || !strings.Contains(err.Error(), "ep_rank") {
					failures <- fmt.Errorf("goroutine %d call %d: %v", g, i, err)
					return
				}
				if i%7 == 0 {
					runtime.Gosched()
				}
			}
		}(g)
	}
	wg.Wait()
	close(failures)
	for err := range failures {
		t.Fatal(err)
	}
}

// A layer of ep 1 with the fixed weights of runRank, in the given act dtype.
func dtypeLayer(t *testing.T, act DType) *Layer {
	m, err := NewExpertMap(ExpertMapConfig{EPSize: 1, Experts: eCount})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	l, err := NewLayer(LayerConfig{Hidden: hSize, Intermediate: iSize, Experts: eCount, TopK: kTop, MaxTokens: tTokens,
		Threads: 1, ActDType: act}, m, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	for e := 0; e < eCount; e++ {
		g, u, d := expertWeights(e)
		gb := make([]uint16, len(g))
		ToBF16(gb, g) // the 16-bit entry point, converted back to f32 by the layer
		FromBF16(g, gb)
		if _, err := l.SetWeight16(WeightExpertGate, int32(e), gb, BF16, iSize, hSize); err != nil {
			t.Fatal(err)
		}
		if _, err := l.SetWeight(WeightExpertUp, int32(e), u, iSize, hSize); err != nil {
			t.Fatal(err)
		}
		if _, err := l.SetWeight(WeightExpertDown, int32(e), d, hSize, iSize); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

func TestForwardSlicesMustMatchTheLayerDType(t *testing.T) {
	lb := dtypeLayer(t, BF16)
	defer lb.Close()
	lf := dtypeLayer(t, F32)
	defer lf.Close()
	x := make([]float32, tTokens*hSize)
	logits := make([]float32, tTokens*eCount)
	for i := range x {
		x[i] = value(i, 1, 17)
	}
	for i := range logits {
		logits[i] = 10 * value(i, 5, 23)
	}
	out := make([]float32, len(x))
	// f32 slices on a bf16 layer: an error, never a wrong answer.
	if err := lb.Forward(x, logits, out); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "act_dtype is BF16") {
		t.Fatalf("got %v", err)
	}
	if err := lf.Forward16(make([]uint16, len(x)), logits, make([]uint16, len(x))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("got %v", err)
	}
	xb := make([]uint16, len(x))
	ToBF16(xb, x)
	FromBF16(x, xb)
	ob := make([]uint16, len(x))
	if err := lb.Forward16(xb, logits, ob); err != nil {
		t.Fatal(err)
	}
	if err := lf.Forward(x, logits, out); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, len(ob))
	FromBF16(got, ob)
	peak := float32(0)
	for _, v := range out {
		if v > peak {
			peak = v
		} else if -v > peak {
			peak = -v
		}
	}
	if peak == 0 {
		t.Fatal("all-zero output")
	}
	for i := range out {
		if d := got[i] - out[i]; d > 1e-2*peak || d < -1e-2*peak {
			t.Fatalf("element %d: bf16 %v, f32 %v", i, got[i], out[i])
		}
	}
}

func TestF16Conversions(t *testing.T) {
	cases := []struct {
		v    float32
		bits uint16
	}{{1, 0x3c00}, {-2, 0xc000}, {65504, 0x7bff}, {65520, 0x7c00}, {6.1035156e-5, 0x0400},
		{5.9604645e-8, 0x0001}, {2.9802322e-8, 0}, {1.00048828125, 0x3c00}, {1.00146484375, 0x3c02}}
	for _, c := range cases {
		var b [1]uint16
		ToF16(b[:], []float32{c.v})
		if b[0] != c.bits {
			t.Errorf("ToF16(%v) = %#x, want %#x", c.v, b[0], c.bits)
		}
	}
	for _, bits := range []uint16{0x3c00, 0xc000, 0x7bff, 0x0400, 0x0001, 0x03ff, 0x8001, 0x7c00} {
		var f [1]float32
		var b [1]uint16
		FromF16(f[:], []uint16{bits})
		ToF16(b[:], f[:])
		if b[0] != bits {
			t.Errorf("round trip of %#x gave %#x", bits, b[0])
		}
	}
}

// writeSafetensors writes f32 tensors as a safetensors file.
func writeSafetensors(t *testing.T, path string, names []string, shapes [][]int, data [][]float32) {
	header := "{"
	off := 0
	for i, n := range names {
		sh := ""
		for j, d := range shapes[i] {
			if j > 0 {
				sh += ","
			}
			sh += fmt.Sprint(d)
		}
		if i > 0 {
			header += ","
		}
		header += fmt.Sprintf("%q:{\"dtype\":\"F32\",\"shape\":[%s],\"data_offsets\":[%d,%d]}", n, sh, off, off+4*len(data[i]))
		off += 4 * len(data[i])
	}
	header += "}"
	buf := make([]byte, 8, 8+len(header)+off)
	binary.LittleEndian.PutUint64(buf, uint64(len(header)))
	buf = append(buf, header...)
	for _, d := range data {
		for _, v := range d {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
		}
	}
	if err := os.WriteFile(path, buf, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointLoadMatchesSetWeight(t *testing.T) {
	dir := t.TempDir()
	gu := make([]float32, eCount*2*iSize*hSize)
	dn := make([]float32, eCount*hSize*iSize)
	router := make([]float32, eCount*hSize)
	for i := range gu {
		gu[i] = value(i, 3, 19)
	}
	for i := range dn {
		dn[i] = value(i, 5, 13)
	}
	for i := range router {
		router[i] = 5 * value(i, 7, 29)
	}
	p := "model.layers.1.mlp."
	writeSafetensors(t, filepath.Join(dir, "model.safetensors"),
		[]string{p + "gate.weight", p + "experts.gate_up_proj", p + "experts.down_proj"},
		[][]int{{eCount, hSize}, {eCount, 2 * iSize, hSize}, {eCount, hSize, iSize}}, [][]float32{router, gu, dn})
	cfg := fmt.Sprintf(`{"model_type": "qwen3_moe", "hidden_size": %d, "num_experts": %d, "num_experts_per_tok": %d, "norm_topk_prob": true}`,
		hSize, eCount, kTop)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	ck, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if a := ck.Architecture(); a != "qwen3_moe" {
		t.Fatalf("architecture %q", a)
	}
	layers, err := ck.MoELayers()
	if err != nil || len(layers) != 1 || layers[0] != 1 {
		t.Fatalf("MoE layers %v, %v", layers, err)
	}
	lc, err := ck.LayerConfig(LayerConfig{MaxTokens: tTokens, Threads: 1}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if lc.Hidden != hSize || lc.Intermediate != iSize || lc.Experts != eCount || lc.TopK != kTop || lc.NoRenormalize ||
		lc.Activation != ActSiLU || lc.Scoring != ScoringSoftmax || lc.MaxTokens != tTokens {
		t.Fatalf("derived %+v", lc)
	}
	if _, err := ck.LayerConfig(LayerConfig{}, 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a dense layer: %v", err)
	}
	m, err := NewExpertMap(lc.MapConfig(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	loaded, err := NewLayer(lc, m, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	defer loaded.Close()
	if err := loaded.Load(ck, 1); err != nil {
		t.Fatal(err)
	}
	given, err := NewLayer(lc, m, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	defer given.Close()
	for e := 0; e < eCount; e++ {
		if _, err := given.SetWeight(WeightExpertGateUp, int32(e), gu[e*2*iSize*hSize:(e+1)*2*iSize*hSize], 2*iSize, hSize); err != nil {
			t.Fatal(err)
		}
		if _, err := given.SetWeight(WeightExpertDown, int32(e), dn[e*hSize*iSize:(e+1)*hSize*iSize], hSize, iSize); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := given.SetWeight(WeightRouter, -1, router, eCount, hSize); err != nil {
		t.Fatal(err)
	}
	x := make([]float32, tTokens*hSize)
	for i := range x {
		x[i] = value(i, 1, 17)
	}
	a, b := make([]float32, len(x)), make([]float32, len(x))
	if err := loaded.Forward(x, nil, a); err != nil {
		t.Fatal(err)
	}
	if err := given.Forward(x, nil, b); err != nil {
		t.Fatal(err)
	}
	nonzero := false
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("element %d: loaded %v, given %v", i, a[i], b[i])
		}
		nonzero = nonzero || a[i] != 0
	}
	if !nonzero {
		t.Fatal("all-zero output")
	}
}

func TestBlockFormatWeights(t *testing.T) {
	if e, b, err := Q4_K.Block(); err != nil || e != 256 || b != 144 {
		t.Fatalf("Q4_K block: %d %d %v", e, b, err)
	}
	if e, b, err := FP8_E4M3.Block(); err != nil || e != 128 || b != 132 || FP8_E4M3.String() != "FP8" {
		t.Fatalf("FP8_E4M3 block: %d %d %v %s", e, b, err, FP8_E4M3.String())
	}
	if _, _, err := DType(1000).Block(); err == nil {
		t.Fatal("DType(1000) has no block")
	}
	m, err := NewExpertMap(ExpertMapConfig{EPSize: 1, EPRank: 0, Experts: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	cfg := LayerConfig{Hidden: 64, Intermediate: 32, Experts: 2, TopK: 1, MaxTokens: 2, Threads: 1}
	l, err := NewLayer(cfg, m, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	gate := make([]byte, 32*2*34) // Q8_0 [32, 64]: scale 1/64 (f16 0x2400)
	for b := 0; b < 64; b++ {
		gate[b*34+1] = 0x24
		for i := 0; i < 32; i++ {
			gate[b*34+2+i] = byte(i * 7)
		}
	}
	if ok, err := l.SetWeightBlocks(WeightExpertGate, 0, gate, Q8_0, 32, 64); err != nil || !ok {
		t.Fatalf("Q8_0 gate: %v %v", ok, err)
	}
	if _, err := l.SetWeightBlocks(WeightExpertGate, 0, gate[1:], Q8_0, 32, 64); err == nil {
		t.Fatal("a short buffer was taken")
	}
	_, err = l.SetWeightBlocks(WeightExpertGate, 1, make([]byte, 32*2*18), Q4_0, 32, 64)
	if err == nil || !strings.Contains(err.Error(), "q8_0") {
		t.Fatalf("another format for the same part: %v", err)
	}
}

func TestShortSlotTablesAreErrors(t *testing.T) {
	// A CustomSlotsPerRank shorter than EPSize: an error, where C read past it.
	slots := []int32{0, 1, 2, 3, 4, 5, 6, 7}
	_, err := NewExpertMap(ExpertMapConfig{EPSize: 4, Experts: 8, Placement: PlacementCustom, CustomSlots: slots,
		CustomSlotsPerRank: []int32{2, 2}})
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "CustomSlotsPerRank has 2 entries, not EPSize = 4") {
		t.Fatalf("got %v", err)
	}
	m, err := NewExpertMap(ExpertMapConfig{EPSize: 4, Experts: 8, Placement: PlacementCustom, CustomSlots: slots,
		CustomSlotsPerRank: []int32{2, 2, 2, 2}})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
}
