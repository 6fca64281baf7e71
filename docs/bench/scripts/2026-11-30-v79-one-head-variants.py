"""Issue 53 evidence (log v79): PTX surgery on rope-rs' one-head decode kernels. Each variant
fixes some run-time choices of the bf16 NeoX one-head kernels (table and computed) to the
decode row's values, so that ptxas folds their branches; the decode-floor harness
(2026-11-30-v79-decode-floor.cu) times each in a 100-launch graph. Run from the repository
root: python3 docs/bench/scripts/2026-11-30-v79-one-head-variants.py OUT_DIR (writes OUT_DIR/*.cubin
and OUT_DIR/variants.txt; PTXAS names ptxas, default: the one `cargo xtask sass` installs)."""
import os, re, subprocess, sys

PTXAS = os.environ.get(
    "PTXAS", "target/ptxas-venv/lib/python3.11/site-packages/nvidia/cu13/bin/ptxas")
out_dir = sys.argv[1]
ptx = open("rope-host/ptx/kernels_sm90.ptx").read()
header = ptx[:re.search(r"^(//\s*\.globl|\.visible|\.func|\.weak|\.extern)", ptx, re.M).start()]


def entry(name):
    i = ptx.index(".visible .entry " + name + "(")
    return header + ptx[i:ptx.index("\n}\n", i) + 3]


def fix(s, name, param, value):
    """Parameter `param` of `name` replaced by the constant `value`."""
    pat = r"ld\.param\.b(32|64)\s+(%rd?\d+), \[" + name + r"_param_" + str(param) + r"\];"
    s, n = re.subn(pat, lambda m: f"mov.b{m.group(1)} \t{m.group(2)}, {value};", s)
    assert n == 1, (name, param, n)
    return s


def position_ids_i64(s):
    """The position kind's jump replaced by a branch to code 6's (ids per row, i64) target."""
    m = re.search(r"\$L_brx_0: \.branchtargets\s*((?:\$L__BB\d+_\d+[,;]?\s*)+)"
                  r"brx\.idx\s+%r\d+, \$L_brx_0;", s)
    targets = re.findall(r"\$L__BB\d+_\d+", m.group(1))
    return s[:m.start()] + f"bra.uni \t{targets[7]};" + s[m.end():]


# Parameter indices in `plain_kernel_params!` order: 35 table_elem, 37 angle_mode,
# 39 position_code, 45 read_ahead.
lines = []
for kernel, tag in [("rope_neox_table_bf16_one_head", "table"),
                    ("rope_neox_theta_bf16_one_head", "computed")]:
    s0 = entry(kernel)
    pos = position_ids_i64(fix(s0, kernel, 39, 6))
    variants = {"orig": s0, "pos6": pos, "ra0": fix(s0, kernel, 45, 0),
                "pos6+ra0": fix(pos, kernel, 45, 0)}
    if tag == "table":
        variants["pos6+ra0+elem0"] = fix(variants["pos6+ra0"], kernel, 35, 0)
    else:
        variants["pos6+ra0+angle0"] = fix(variants["pos6+ra0"], kernel, 37, 0)
    for label, text in variants.items():
        src = os.path.join(out_dir, f"{tag}-{label}.ptx")
        cubin = f"{tag}-{label}.cubin"
        open(src, "w").write(text)
        r = subprocess.run([PTXAS, "-arch=sm_90", "-v", "-o", os.path.join(out_dir, cubin), src],
                           capture_output=True, text=True, check=True)
        print(tag, label, re.findall(r"Used \d+ registers|\d+ bytes spill stores", r.stderr))
        lines.append(f"{tag}-{label}:{cubin}:{kernel}:{tag}")
open(os.path.join(out_dir, "variants.txt"), "w").write("\n".join(lines) + "\n")
