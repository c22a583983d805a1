"""petite's TensorRT-RTX engine builder, run once per engine as a child process.

petite embeds this file (include_str!) and runs it with a Python that can `import tensorrt_rtx`
(pip install "tensorrt-rtx-cu13==1.7.1.116"). Only the standard library and tensorrt_rtx are
used. One engine per process: everything the builder allocated goes back to the OS on exit.

    trt_rtx_build.py --probe
        stdout: {"builder":"tensorrt-rtx","version":"1.7.1.116","targets":["sm75",...]}

    trt_rtx_build.py --onnx E.onnx --plan OUT --target sm86 [--workspace-mib N]
                     [--weight-streaming]
        Parses E.onnx from its file (external data resolves next to it) into a strongly typed
        network, builds for exactly that one compute capability (no GPU needed), streams the
        serialized plan into OUT and prints one line on stdout:
        {"builder":"tensorrt-rtx","version":"...","plan_bytes":N,"build_s":F,"layers":N,
         "weight_streaming":B}
        ("build_s": parse + build + write, seconds; "layers": the parsed network's layers — the
        built engine cannot be inspected without a GPU it runs on; "weight_streaming": whether
        BuilderFlag.WEIGHT_STREAMING was set on the builder config, read back from it — the
        plan's streamable size can only be read after deserializing it on a GPU it runs on).

The builder's warnings and errors, and every parser error, go to stderr. Exit status:
    0  built (or probed)
    1  anything else (I/O error writing OUT, unexpected exception); OUT is removed
    2  the ONNX did not parse: one stderr line per parser error
    3  `import tensorrt_rtx` failed: one stderr line
    4  --target is not one this TensorRT-RTX builds for: one stderr line naming the valid ones
    5  the build failed (no plan): the builder's last error on stderr (its last line); OUT is
       removed
    64 bad command line
"""

import json
import os
import sys
import time

BUILDER = "tensorrt-rtx"
EXIT_OTHER, EXIT_PARSE, EXIT_IMPORT, EXIT_TARGET, EXIT_BUILD, EXIT_USAGE = 1, 2, 3, 4, 5, 64

USAGE = (
    "usage: trt_rtx_build.py --probe\n"
    "       trt_rtx_build.py --onnx E.onnx --plan OUT --target smXY"
    " [--workspace-mib N] [--weight-streaming]"
)


def fail(code, msg):
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.stderr.flush()
    sys.exit(code)


def parse_args(argv):
    """A hand-rolled parser: argparse exits 2 on usage errors, which is the parse-error code."""
    opts = {"probe": False, "onnx": None, "plan": None, "target": None,
            "workspace_mib": None, "weight_streaming": False}
    valued = {"--onnx": "onnx", "--plan": "plan", "--target": "target",
              "--workspace-mib": "workspace_mib"}
    i = 0
    while i < len(argv):
        a = argv[i]
        key, val = a, None
        if a.startswith("--") and "=" in a:
            key, val = a.split("=", 1)
        if key == "--probe" and val is None:
            opts["probe"] = True
        elif key == "--weight-streaming" and val is None:
            opts["weight_streaming"] = True
        elif key in valued:
            if val is None:
                i += 1
                if i >= len(argv):
                    fail(EXIT_USAGE, f"{key} needs a value\n{USAGE}")
                val = argv[i]
            opts[valued[key]] = val
        elif key in ("-h", "--help"):
            sys.stdout.write(__doc__)
            sys.exit(0)
        else:
            fail(EXIT_USAGE, f"unknown argument {a!r}\n{USAGE}")
        i += 1
    if opts["probe"]:
        return opts
    for k in ("onnx", "plan", "target"):
        if not opts[k]:
            fail(EXIT_USAGE, f"--{k} is required\n{USAGE}")
    if opts["workspace_mib"] is not None:
        try:
            opts["workspace_mib"] = int(opts["workspace_mib"])
            if opts["workspace_mib"] <= 0:
                raise ValueError
        except ValueError:
            fail(EXIT_USAGE, f"--workspace-mib wants a positive integer, got "
                             f"{opts['workspace_mib']!r}")
    return opts


def import_trt():
    try:
        import tensorrt_rtx as trt
    except Exception as e:  # ImportError, or OSError from a missing libtensorrt_rtx.so
        fail(EXIT_IMPORT, f"cannot import tensorrt_rtx ({type(e).__name__}: {e}); "
                          f"pip install \"tensorrt-rtx-cu13==1.7.1.116\" into {sys.executable}")
    return trt


def targets(trt):
    """{"sm86": ComputeCapability.SM86, ...}, in ascending order."""
    out = {}
    for name, member in trt.ComputeCapability.__members__.items():
        if name.startswith("SM") and name[2:].isdigit():
            out[name.lower()] = member
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][2:])))


def main(argv):
    opts = parse_args(argv)
    trt = import_trt()
    version = trt.__version__
    valid = targets(trt)

    if opts["probe"]:
        print(json.dumps({"builder": BUILDER, "version": version, "targets": list(valid)},
                         separators=(",", ":")), flush=True)
        return 0

    target = opts["target"].lower()
    if target not in valid:
        fail(EXIT_TARGET, f"target {opts['target']!r} is not one TensorRT-RTX {version} builds "
                          f"for; valid: {', '.join(valid)}")

    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.ERROR:
                self.errors.append(msg)
            if severity <= trt.ILogger.WARNING:
                tag = {trt.ILogger.INTERNAL_ERROR: "internal error",
                       trt.ILogger.ERROR: "error"}.get(severity, "warning")
                sys.stderr.write(f"tensorrt-rtx {tag}: {msg}\n")
                sys.stderr.flush()

    logger = Log()

    def builder_error():
        # Without a GPU every failed build also logs "cudaError 35: CUDA driver version is
        # insufficient" from the CUDA-less error path; the cause is the error before it.
        real = [m for m in logger.errors if "cudaError 35" not in m]
        return (real or logger.errors or ["no error logged"])[-1]

    t0 = time.monotonic()
    builder = trt.Builder(logger)
    network = builder.create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    onnx_path = os.path.abspath(opts["onnx"])
    if not parser.parse_from_file(onnx_path):
        n = parser.num_errors
        for i in range(n):
            e = parser.get_error(i)
            node = e.node_name() or (f"#{e.node()}" if e.node() >= 0 else "-")
            op = e.node_operator()
            sys.stderr.write(f"parse error {i + 1}/{n}: node {node}"
                             f"{' (' + op + ')' if op else ''}: {e.desc()}\n")
        if n == 0:
            sys.stderr.write(f"parse error: {onnx_path} did not parse "
                             f"({builder_error()})\n")
        sys.stderr.flush()
        return EXIT_PARSE
    layers = network.num_layers

    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(valid[target], 0)
    if opts["workspace_mib"] is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts["workspace_mib"] << 20)
    if opts["weight_streaming"]:
        # Weight streaming needs a strongly typed network (the network above is one).
        config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
    weight_streaming = bool(config.get_flag(trt.BuilderFlag.WEIGHT_STREAMING))

    plan_path = opts["plan"]

    class Sink(trt.IStreamWriter):
        def __init__(self, f):
            trt.IStreamWriter.__init__(self)
            self.f = f
            self.n = 0
            self.error = None

        def write(self, data):
            try:
                self.f.write(data)
            except Exception as e:  # reported after the build returns
                self.error = e
                return 0
            self.n += len(data)
            return len(data)

    try:
        with open(plan_path, "wb") as f:
            sink = Sink(f)
            ok = builder.build_serialized_network_to_stream(network, config, sink)
            if sink.error is not None:
                raise sink.error
    except BaseException:
        _remove(plan_path)
        raise
    if not ok or sink.n == 0:
        _remove(plan_path)
        fail(EXIT_BUILD, f"the build produced no plan: {builder_error()}")
    build_s = time.monotonic() - t0
    print(json.dumps({"builder": BUILDER, "version": version, "plan_bytes": sink.n,
                      "build_s": round(build_s, 3), "layers": layers,
                      "weight_streaming": weight_streaming},
                     separators=(",", ":")), flush=True)
    return 0


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit:
        raise
    except BaseException as e:
        fail(EXIT_OTHER, f"trt_rtx_build.py: {type(e).__name__}: {e}")
    sys.exit(code)
