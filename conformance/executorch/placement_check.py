"""Checks petite's delegate memory placement against ExecuTorch's own exporter.

usage: placement_check.py (device|host) FILE.pte...

For each file's `forward` method, read with ExecuTorch's deserializer (`deserialize_pte_binary`),
this script rebuilds the method's delegate dataflow as a PyTorch module — one submodule per
delegate call, consuming the same values (method inputs, earlier delegates' outputs) and producing
outputs of the same dtypes and shapes — and exports it with ExecuTorch 1.5.1 (`torch.export`,
`to_edge_transform_and_lower` with a partitioner that gives each submodule its own delegate, then
`to_executorch()` with the default memory planning). `device` tags every delegate with the
`target_device=cuda:0` compile spec (as Torch-TensorRT's partitioner does), `host` does not.

Both programs are then described in the same canonical terms — values named by where they come
from (method input j, a copy of a value, delegate k's output i), not by index — and compared field
by field: the instruction sequence (copy operators, where they sit, each delegate's argument list),
every tensor's dtype, sizes, planned buffer and device tag (`extra_tensor_info`), which planned
buffers exist and their devices (`non_const_buffer_device`), the operator table, each delegate's
`target_device` compile spec, the method's inputs and outputs. Buffer sizes and offsets are not
compared (ExecuTorch reuses memory by lifetime, petite plans each value its own slot); both
programs must keep every tensor inside its buffer. Exit 1 on the first difference, naming it.
"""

import sys

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.schema import (
    DelegateCall,
    DeviceType,
    KernelCall,
    Tensor,
    TensorDataLocation,
)

H2D = "et_copy::_h2d_copy"
D2H = "et_copy::_d2h_copy"

# ExecuTorch ScalarType codes → torch dtypes (the ones petite's programs carry).
DTYPES = {
    0: torch.uint8,
    1: torch.int8,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    11: torch.bool,
    15: torch.bfloat16,
}


def fail(msg):
    print(f"placement_check: {msg}", file=sys.stderr)
    sys.exit(1)


class TensorRTBackend(BackendDetails):
    """A stand-in backend with Torch-TensorRT's id: the structure, not the payload, is compared."""

    @staticmethod
    def preprocess(edge_program, compile_specs):
        return PreprocessResult(processed_bytes=b"mirror")


class PerPart(Partitioner):
    """Delegates each `part{k}` submodule's nodes as delegate k."""

    def __init__(self, n, device):
        super().__init__()
        specs = [CompileSpec("target_device", b"cuda:0")] if device else []
        self.delegation = DelegationSpec(TensorRTBackend.__name__, specs)
        self.n = n

    def partition(self, ep):
        tags = {}
        for node in ep.graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            stack = node.meta.get("nn_module_stack") or {}
            parts = [p for (p, _) in stack.values() if p.startswith("part")]
            if parts:
                tag = f"tag{parts[-1][4:]}"
                node.meta["delegation_tag"] = tag
                tags[tag] = self.delegation
        if len(tags) != self.n:
            fail(f"mirror partitioner tagged {len(tags)} delegates, expected {self.n}")
        return PartitionResult(tagged_exported_program=ep, partition_tags=tags)


class Part(torch.nn.Module):
    """Outputs of the given dtypes and shapes that depend on every input, in input order."""

    def __init__(self, outs):
        super().__init__()
        self.outs = outs

    def forward(self, *xs):
        acc = xs[0].to(torch.float32).sum()
        for x in xs[1:]:
            acc = acc + x.to(torch.float32).sum()
        return tuple(torch.zeros(s, dtype=torch.float32).add(acc).to(d) for (d, s) in self.outs)


class Mirror(torch.nn.Module):
    def __init__(self, flow):
        super().__init__()
        self.flow = flow
        for k, (_, outs) in enumerate(flow["delegates"]):
            setattr(self, f"part{k}", Part([(DTYPES[t], s) for (t, s) in outs]))

    def forward(self, *inputs):
        env = {f"in{j}": x for j, x in enumerate(inputs)}
        for k, (ins, outs) in enumerate(self.flow["delegates"]):
            res = getattr(self, f"part{k}")(*[env[o] for o in ins])
            for i, r in enumerate(res):
                env[f"d{k}.out{i}"] = r
        return tuple(env[o] for o in self.flow["outputs"])


def describe(program, method="forward"):
    """The canonical description of `method`: steps, values, buffers, operators, delegates."""
    plans = [p for p in program.execution_plan if p.name == method]
    if len(plans) != 1:
        fail(f"no single method {method!r}")
    plan = plans[0]
    devices = {d.buffer_idx: (DeviceType(d.device_type).name, d.device_index)
               for d in (plan.non_const_buffer_device or [])}
    names = {}
    copies = {}
    values = {}

    def tensor_desc(vi):
        t = plan.values[vi].val
        if not isinstance(t, Tensor):
            fail(f"value {vi} is not a tensor")
        a = t.allocation_info
        mem = None
        if a is not None:
            off = a.memory_offset_low | (a.memory_offset_high << 32)
            mem = a.memory_id
            size = plan.non_const_buffer_sizes[mem]
            nbytes = 1
            for s in t.sizes:
                nbytes *= s
            if off + nbytes * torch.tensor([], dtype=DTYPES[int(t.scalar_type)]).element_size() > size:
                fail(f"value {vi} runs past planned buffer {mem}")
        e = t.extra_tensor_info
        extra = None if e is None else (e.mutable_data_segments_idx, e.fully_qualified_name,
                                        TensorDataLocation(e.location).name,
                                        DeviceType(e.device_type).name, e.device_index)
        return {
            "dtype": int(t.scalar_type),
            "sizes": list(t.sizes),
            "buffer": None if mem is None else (mem, devices.get(mem, ("CPU", 0))),
            "extra_tensor_info": extra,
        }

    def name(vi, as_new):
        if vi in names:
            return names[vi]
        names[vi] = as_new
        values[as_new] = tensor_desc(vi)
        return as_new

    for j, vi in enumerate(plan.inputs):
        name(vi, f"in{j}")
    steps = []
    delegates = []
    k = 0
    for chain in plan.chains:
        for ins in chain.instructions:
            i = ins.instr_args
            if isinstance(i, KernelCall):
                op = plan.operators[i.op_index]
                full = f"{op.name}.{op.overload}"
                if full not in (f"{H2D}.out", f"{D2H}.out"):
                    fail(f"unexpected kernel {full}")
                src, dst, ret = i.args
                if dst != ret:
                    fail(f"{full}: out and return values differ ({dst}, {ret})")
                s = names.get(src) or fail(f"{full} copies value {src} before it is defined")
                kind = "h2d" if full.startswith(H2D) else "d2h"
                n = copies.get((kind, s), 0)
                copies[(kind, s)] = n + 1
                d = name(dst, f"{kind}#{n}({s})")
                steps.append((kind, s, d))
            elif isinstance(i, DelegateCall):
                args = []
                ins_, outs = [], []
                for vi in i.args:
                    if vi in names:
                        if outs:
                            fail(f"delegate call {k}: input {vi} after an output")
                        args.append(names[vi])
                        ins_.append(vi)
                    else:
                        args.append(name(vi, f"d{k}.out{len(outs)}"))
                        outs.append(vi)
                d = plan.delegates[i.delegate_index]
                specs = {c.key: bytes(c.value).decode() for c in d.compile_specs}
                steps.append(("delegate", k, d.id, specs.get("target_device"), args))
                delegates.append((ins_, outs))
                k += 1
            else:
                fail(f"unexpected instruction {type(i).__name__}")
    outputs = [names.get(vi) or fail(f"output value {vi} is never written") for vi in plan.outputs]
    ops = [f"{o.name}.{o.overload}" for o in plan.operators]
    return {
        "plan": plan,
        "steps": steps,
        "values": values,
        "inputs": [names[v] for v in plan.inputs],
        "outputs": outputs,
        "operators": ops,
        "buffers": len(plan.non_const_buffer_sizes),
        "buffer_devices": sorted(devices.items()),
        "delegates": delegates,
    }


def origin(name):
    """The value a (chain of) copies started from."""
    while "(" in name:
        name = name[name.index("(") + 1:-1]
    return name


def flow_of(desc):
    """Delegate inputs by origin, delegate output dtypes/shapes, method outputs by origin."""
    plan = desc["plan"]
    flows = []
    for step in desc["steps"]:
        if step[0] != "delegate":
            continue
        args = step[4]
        ins = [origin(a) for a in args if not a.startswith(f"d{step[1]}.out")]
        outs = [a for a in args if a.startswith(f"d{step[1]}.out")]
        flows.append((ins, [(desc["values"][o]["dtype"], desc["values"][o]["sizes"]) for o in outs]))
    del plan
    return {"delegates": flows, "outputs": [origin(o) for o in desc["outputs"]]}


def mirror(desc, device):
    flow = flow_of(desc)
    example = []
    for n in desc["inputs"]:
        v = desc["values"][n]
        example.append(torch.zeros(v["sizes"], dtype=DTYPES[v["dtype"]]))
    m = Mirror(flow).eval()
    ep = torch.export.export(m, tuple(example), strict=False)
    edge = to_edge_transform_and_lower(ep, partitioner=[PerPart(len(flow["delegates"]), device)])
    et = edge.to_executorch()
    return describe(deserialize_pte_binary(et.buffer).program)


def compare(path, ours, theirs):
    for key in ["inputs", "outputs", "operators", "buffers", "buffer_devices"]:
        if ours[key] != theirs[key]:
            fail(f"{path}: {key}: petite {ours[key]} != ExecuTorch {theirs[key]}")
    if len(ours["steps"]) != len(theirs["steps"]):
        fail(f"{path}: {len(ours['steps'])} instructions, ExecuTorch {len(theirs['steps'])}:\n"
             f"  petite    {ours['steps']}\n  ExecuTorch {theirs['steps']}")
    for n, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        if a != b:
            fail(f"{path}: instruction {n}: petite {a} != ExecuTorch {b}")
    if sorted(ours["values"]) != sorted(theirs["values"]):
        fail(f"{path}: values {sorted(ours['values'])} != {sorted(theirs['values'])}")
    for n in ours["values"]:
        a, b = dict(ours["values"][n]), dict(theirs["values"][n])
        # Buffer index and device must agree; offsets are the planners' own business.
        if a != b:
            fail(f"{path}: value {n}: petite {a} != ExecuTorch {b}")


def main():
    mode, files = sys.argv[1], sys.argv[2:]
    if mode not in ("device", "host") or not files:
        fail("usage: placement_check.py (device|host) FILE.pte...")
    for path in files:
        program = deserialize_pte_binary(open(path, "rb").read()).program
        ours = describe(program)
        for p in program.execution_plan:
            if p.name != "forward" and p.non_const_buffer_device:
                fail(f"{path}: method {p.name} has device buffers")
        theirs = mirror(ours, mode == "device")
        compare(path, ours, theirs)
        copies = sum(1 for s in ours["steps"] if s[0] in ("h2d", "d2h"))
        bufs = ", ".join(f"buffer {k} on {d}:{i}" for (k, (d, i)) in ours["buffer_devices"])
        print(f"  {path}: {mode} placement equals ExecuTorch 1.5.1's: {len(ours['delegates'])} "
              f"delegates, {copies} copies, {bufs or 'every buffer on the host'}, "
              f"{len(ours['values'])} tensors")


if __name__ == "__main__":
    main()
