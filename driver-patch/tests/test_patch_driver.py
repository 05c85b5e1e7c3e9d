"""Tests of patch_driver.py on SYNTHETIC source trees written here in the shapes of the 525-595
branches (the real files are NVIDIA's and are never copied into this repository)."""
import os
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
APPLIER = os.path.join(HERE, "..", "patch_driver.py")
BUILDER = os.path.join(HERE, "..", "..", "scripts", "build-driver.sh")

# Flag bit layouts: 525-550 and 560+ (values as in those branches' control.h).
OLD_BITS = {"NON_PRIVILEGED": 0x10, "GPU_LOCK_DEVICE_ONLY": 0x40, "ROUTE_TO_PHYSICAL": 0x200, "API_LOCK_READONLY": 0x800}
NEW_BITS = {"NON_PRIVILEGED": 0x8, "GPU_LOCK_DEVICE_ONLY": 0x10, "ROUTE_TO_PHYSICAL": 0x40, "API_LOCK_READONLY": 0x100,
            "GSP_PLUGIN_FOR_VGPU_GSP": 0x10000}


def write(path, data, mode="w"):
    with open(path, mode) as f:
        f.write(data)


def read(path):
    with open(path) as f:
        return f.read()


def control_h(bits):
    lines = ["// synthetic control.h for tests", "#define RMCTRL_FLAGS_NONE                 0x000000000"]
    lines += [f"#define RMCTRL_FLAGS_{k:<28} 0x{v:09x}" for k, v in bits.items()]
    return "\n".join(lines) + "\n"


def entry(index, method_id, flags, func, amp=""):
    return f"""    {{               /*  [{index}] */
#if NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)
        /*pFunc=*/      (void (*)(void)) NULL,
#else
        /*pFunc=*/      (void (*)(void)) {amp}{func}_IMPL,
#endif // NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)
        /*flags=*/      {flags:#x}u,
        /*accessRight=*/0x0u,
        /*methodId=*/   {method_id:#x}u,
        /*paramSize=*/  sizeof(SYNTHETIC_PARAMS),
        /*pClassInfo=*/ &(__nvoc_class_def_Subdevice.classInfo),
#if NV_PRINTF_STRINGS_ALLOWED
        /*func=*/       "{func}"
#endif
    }},
"""


MACRO = "#define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x)      (0)\n"


def generated(flags, amp="", extra=(), macro=MACRO):
    body = "// synthetic generated table\n" + macro
    body += "static const struct NVOC_EXPORTED_METHOD_DEF table[] = {\n"
    body += entry(211, 0x2080110A, 0x10, "subdeviceCtrlCmdDecoyA", amp)
    body += entry(212, 0x2080110B, flags, "subdeviceCtrlCmdFifoDisableChannels", amp)
    body += entry(213, 0x20801B0B, 0x10, "subdeviceCtrlCmdDecoyB", amp)
    body += entry(214, 0x2080110B0, 0x810, "subdeviceCtrlCmdDecoyLongerId", amp)
    for e in extra:
        body += e
    body += "};\n\n// decoys outside the table: a comment naming the id, and a similar id\n"
    body += "    // subdeviceCtrlCmdFifoDisableChannels -- exported (id=0x2080110b)\n"
    body += f"#if !NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)\n#endif\n"
    body += "static const unsigned similar = 0x2080110bau; /*methodId=*/ /* 0x2080110b0u */\n"
    return body


def make_tree(root, version, bits, flags, amp="", extra=(), control=True, macro=MACRO):
    os.makedirs(os.path.join(root, "src/nvidia/generated"))
    os.makedirs(os.path.join(root, "src/nvidia/inc/kernel/rmapi"))
    write(os.path.join(root, "version.mk"), f"NVIDIA_VERSION = {version}\n")
    if control:
        write(os.path.join(root, "src/nvidia/inc/kernel/rmapi/control.h"), control_h(bits))
    write(os.path.join(root, "src/nvidia/generated/g_subdevice_nvoc.c"), generated(flags, amp, extra, macro))
    return root


def run(*args):
    r = subprocess.run([sys.executable, APPLIER, *args], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def gen_text(root):
    return read(os.path.join(root, "src/nvidia/generated/g_subdevice_nvoc.c"))


class Applier(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def tree(self, name, *a, **kw):
        return make_tree(os.path.join(self.dir, name), *a, **kw)

    def assert_one_line_changed(self, before, after, old, new):
        b, a = before.splitlines(), after.splitlines()
        diff = [(x, y) for x, y in zip(b, a) if x != y]
        self.assertEqual(len(b), len(a))
        self.assertEqual(len(diff), 1, diff)
        self.assertIn(f"/*flags=*/      {old:#x}u,", diff[0][0])
        self.assertIn(f"/*flags=*/      {new:#x}u,", diff[0][1])

    def test_each_branch_shape_gets_its_own_bit(self):
        cases = [("535.261.03", OLD_BITS, 0x810, 0x850, ""), ("550.163.01", OLD_BITS, 0x810, 0x850, ""),
                 ("560.35.03", NEW_BITS, 0x108, 0x118, ""), ("580.142", NEW_BITS, 0x10108, 0x10118, "&"),
                 ("595.45.04", NEW_BITS, 0x10108, 0x10118, "&")]
        for version, bits, old, new, amp in cases:
            with self.subTest(version=version):
                root = self.tree(version, version, bits, old, amp)
                before = gen_text(root)
                code, out = run("--src", root)
                self.assertEqual(code, 0, out)
                self.assertIn(version, out)
                self.assert_one_line_changed(before, gen_text(root), old, new)

    def test_route_to_physical_option(self):
        root = self.tree("t", "580.142", NEW_BITS, 0x10108, "&")
        before = gen_text(root)
        code, out = run("--src", root, "--flag", "route-to-physical")
        self.assertEqual(code, 0, out)
        self.assert_one_line_changed(before, gen_text(root), 0x10108, 0x10148)

    def test_idempotent_and_check_codes(self):
        root = self.tree("t", "535.261.03", OLD_BITS, 0x810)
        code, out = run("--src", root, "--check")
        self.assertEqual(code, 10, out)
        self.assertIn("not patched", out)
        self.assertEqual(run("--src", root)[0], 0)
        once = gen_text(root)
        code, out = run("--src", root)
        self.assertEqual(code, 0)
        self.assertIn("already patched", out)
        self.assertEqual(gen_text(root), once)
        self.assertEqual(run("--src", root, "--check")[0], 0)

    def test_check_changes_nothing(self):
        root = self.tree("t", "570.211.01", NEW_BITS, 0x108)
        before = gen_text(root)
        run("--src", root, "--check")
        self.assertEqual(gen_text(root), before)

    def test_emitted_patch_is_one_line_and_stable(self):
        root = self.tree("t", "580.142", NEW_BITS, 0x10108, "&")
        p1, p2 = os.path.join(self.dir, "1.patch"), os.path.join(self.dir, "2.patch")
        self.assertEqual(run("--src", root, "--emit-patch", p1)[0], 0)
        self.assertEqual(run("--src", root, "--emit-patch", p2)[0], 0)  # already patched
        text = read(p1)
        self.assertEqual(text, read(p2))
        changed = [l for l in text.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
        self.assertEqual(changed, ["-        /*flags=*/      0x10108u,", "+        /*flags=*/      0x10118u,"])

    def test_refusals_change_nothing(self):
        # Two entries with the method id.
        root = self.tree("dup", "580.142", NEW_BITS, 0x10108, extra=[entry(300, 0x2080110B, 0x8, "dup")])
        before = gen_text(root)
        code, out = run("--src", root)
        self.assertEqual(code, 4, out)
        self.assertIn("2 entries", out)
        self.assertEqual(gen_text(root), before)
        # No such entry.
        root = self.tree("none", "580.142", NEW_BITS, 0x10108)
        path = os.path.join(root, "src/nvidia/generated/g_subdevice_nvoc.c")
        write(path, gen_text(root).replace("0x2080110bu", "0x2080110cu"))
        code, out = run("--src", root)
        self.assertEqual(code, 4, out)
        self.assertIn("no exported-method entry", out)
        # Entry without a flags line.
        root = self.tree("noflags", "580.142", NEW_BITS, 0x10108)
        path = os.path.join(root, "src/nvidia/generated/g_subdevice_nvoc.c")
        text = gen_text(root)
        i = text.index("0x2080110bu")
        j = text.rindex("/*flags=*/", 0, i)
        write(path, text[:j] + "/*flagz=*/" + text[j + 10:])
        code, out = run("--src", root)
        self.assertEqual(code, 4, out)
        self.assertIn("0 /*flags=*/ lines", out)
        # Flags not a hex literal, and an entry with two flags lines: not parseable, refused.
        for name, bad in (("symbolic", "/*flags=*/      (RMCTRL_FLAGS_NON_PRIVILEGED | 0x100u),"),
                          ("twice", "/*flags=*/      0x10108u,\n        /*flags=*/      0x10108u,")):
            with self.subTest(name):
                root = self.tree(name, "580.142", NEW_BITS, 0x10108)
                path = os.path.join(root, "src/nvidia/generated/g_subdevice_nvoc.c")
                text = gen_text(root)
                j = text.rindex("/*flags=*/", 0, text.index("0x2080110bu"))
                write(path, text[:j] + bad + text[text.index("\n", j):])
                before = gen_text(root)
                code, out = run("--src", root)
                self.assertEqual(code, 4, out)
                self.assertIn(f"has {0 if name == 'symbolic' else 2} /*flags=*/ lines", out)
                self.assertEqual(gen_text(root), before)
        # control.h without the flag.
        root = self.tree("noctl", "580.142", {"NON_PRIVILEGED": 8}, 0x10108)
        code, out = run("--src", root)
        self.assertEqual(code, 4, out)
        self.assertIn("does not define RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY", out)
        # control.h missing.
        root = self.tree("nocontrol", "580.142", NEW_BITS, 0x10108, control=False)
        self.assertEqual(run("--src", root)[0], 4)

    def test_525_shape_is_refused_for_the_default_flag(self):
        # 525: the entry lacks API_LOCK_READONLY, so the API lock still serialises every GPU.
        root = self.tree("t", "525.147.05", OLD_BITS, 0x10)
        before = gen_text(root)
        for extra in ((), ("--check",)):
            code, out = run("--src", root, *extra)
            self.assertEqual(code, 4, out)
            self.assertIn("unsupported", out)
            self.assertIn("RMCTRL_FLAGS_API_LOCK_READONLY", out)
        self.assertEqual(gen_text(root), before)
        # The experimental flag is still possible there (its own bit, read from control.h), with a warning.
        code, out = run("--src", root, "--flag", "route-to-physical")
        self.assertEqual(code, 0, out)
        self.assertIn("warning", out)
        self.assert_one_line_changed(before, gen_text(root), 0x10, 0x210)

    def test_refuses_when_the_disable_macro_reads_the_flags(self):
        root = self.tree("t", "580.142", NEW_BITS, 0x10108, "&",
                         macro="#define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x)      ((x) & 0x10)\n")
        before = gen_text(root)
        code, out = run("--src", root)
        self.assertEqual(code, 4, out)
        self.assertIn("NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG", out)
        self.assertEqual(gen_text(root), before)

    def test_version_from_nvver_h_and_help(self):
        root = self.tree("t", "580.142", NEW_BITS, 0x10108, "&")
        os.remove(os.path.join(root, "version.mk"))
        os.makedirs(os.path.join(root, "src/common/inc"))
        write(os.path.join(root, "src/common/inc/nvVer.h"), '#define NV_VERSION_STRING "580.999"\n')
        code, out = run("--src", root, "--check")
        self.assertEqual(code, 10, out)
        self.assertIn("driver 580.999", out)
        self.assertIn("old flags 0x10108", out)
        code, out = run("--help")
        self.assertEqual(code, 0)
        for c in (" 0 ", "10 ", " 2 ", " 3 ", " 4 "):
            self.assertIn(c, out)

    def test_refuses_packaged_and_proprietary_trees(self):
        root = os.path.join(self.dir, "NVIDIA-Linux-x86_64-580.142")
        os.makedirs(os.path.join(root, "kernel/nvidia"))
        write(os.path.join(root, "kernel/nvidia/nv-kernel.o_binary"), b"\x7fELF", "wb")
        code, out = run("--src", root)
        self.assertEqual(code, 3, out)
        self.assertIn("prebuilt resource manager", out)
        empty = os.path.join(self.dir, "empty")
        os.makedirs(empty)
        code, out = run("--src", empty)
        self.assertEqual(code, 4)
        self.assertIn("not an open-gpu-kernel-modules tree", out)
        self.assertEqual(run("--src", os.path.join(self.dir, "missing"))[0], 2)


# A stand-in for the tree's top-level Makefile: records the goals and arguments, makes the .ko files.
FAKE_MAKEFILE = """modules:
\techo "modules $(SYSSRC) $(SYSOUT)" >> make.log
\ttouch kernel-open/nvidia.ko kernel-open/nvidia-uvm.ko
modules_install:
\techo modules_install >> make.log
\tif [ -n "$(VALVE_TEST_KO)" ]; then cp "$(VALVE_TEST_KO_SRC)" "$(VALVE_TEST_KO)"; fi
"""


class BuildDriver(unittest.TestCase):
    """build-driver.sh on synthetic trees whose Makefile only records what it was asked to do."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.headers = os.path.join(self.dir, "headers")
        os.makedirs(self.headers)
        write(os.path.join(self.headers, "Makefile"), "# fake kernel headers\n")
        # Stubs that record any attempt to load or unload a module (the script must never do it).
        self.bin = os.path.join(self.dir, "bin")
        self.calls = os.path.join(self.dir, "module-calls")
        os.makedirs(self.bin)
        for tool in ("rmmod", "modprobe", "insmod", "nvidia-smi", "dkms", "mokutil", "depmod", "modinfo"):
            record = f"echo {tool} \"$@\" >> {self.calls}\n" if tool in ("rmmod", "modprobe", "insmod") else ""
            write(os.path.join(self.bin, tool), f"#!/bin/sh\n{record}exit 1\n")
            os.chmod(os.path.join(self.bin, tool), 0o755)

    def tearDown(self):
        self.tmp.cleanup()

    def tree(self, version, bits, flags):
        root = make_tree(os.path.join(self.dir, version), version, bits, flags)
        os.makedirs(os.path.join(root, "kernel-open"))
        write(os.path.join(root, "Makefile"), FAKE_MAKEFILE)
        return root

    def build(self, *args, **extra_env):
        env = dict(os.environ, PATH=f"{self.bin}:/usr/bin:/bin", **extra_env)
        r = subprocess.run(["bash", BUILDER, *args], capture_output=True, text=True, env=env)
        return r.returncode, r.stdout + r.stderr

    def test_patches_builds_and_reminds_without_loading(self):
        root = self.tree("580.142", NEW_BITS, 0x10108)
        code, out = self.build("--src", root, "--kernel-headers", self.headers, "--kernel-output", "/o", "--jobs", "1")
        self.assertEqual(code, 0, out)
        self.assertIn("0x10108 -> 0x10118", out)
        self.assertIn("REMINDER", out)
        self.assertEqual(read(os.path.join(root, "make.log")), f"modules {self.headers} /o\n")
        self.assertTrue(os.path.exists(os.path.join(root, "kernel-open/nvidia.ko")))
        self.assertFalse(os.path.exists(self.calls), "build-driver.sh ran a module (un)loading command")

    @unittest.skipUnless(os.geteuid() == 0, "--install needs root")
    def test_install_checks_what_modprobe_would_load(self):
        # The fake modules_install copies a module image carrying the given flags where the modinfo stub points;
        # depmod and modinfo are stubs, so nothing on this machine is installed or indexed.
        root = self.tree("580.142", NEW_BITS, 0x10108)
        installed = os.path.join(self.dir, "lib/modules/kernel/drivers/video/nvidia.ko")
        os.makedirs(os.path.dirname(installed))
        write(os.path.join(self.bin, "modinfo"), f"#!/bin/sh\necho {installed}\n")
        write(os.path.join(self.bin, "depmod"), f"#!/bin/sh\necho depmod \"$@\" >> {self.dir}/depmod-calls\n")
        for flags, expect in ((0x10118, "which carries the patched flags 0x10118"),
                              (0x10108, f"WARNING: {installed} carries flags 0x10108, expected 0x10118")):
            with self.subTest(flags=hex(flags)):
                image = os.path.join(self.dir, "image.ko")
                write(image, b"\0" * 16 + struct.pack("<QIII", 0, flags, 0, 0x2080110B), "wb")
                code, out = self.build("--src", root, "--kernel-headers", self.headers, "--install", "--allow-unsigned",
                                       VALVE_TEST_KO=installed, VALVE_TEST_KO_SRC=image)
                self.assertEqual(code, 0, out)
                self.assertIn(expect, out)
                self.assertIn("REMINDER", out)
        # A module elsewhere (DKMS's updates/) that was not just written shadows the patched one.
        shadow = os.path.join(self.dir, "updates-dkms-nvidia.ko")
        write(shadow, "")
        os.utime(shadow, (1, 1))
        write(os.path.join(self.bin, "modinfo"), f"#!/bin/sh\necho {shadow}\n")
        code, out = self.build("--src", root, "--kernel-headers", self.headers, "--install", "--allow-unsigned")
        self.assertEqual(code, 0, out)
        self.assertIn(f"WARNING: modprobe would load {shadow}, not the module just installed", out)
        self.assertIn("modules_install", read(os.path.join(root, "make.log")))
        self.assertIn("depmod -a", read(os.path.join(self.dir, "depmod-calls")))
        self.assertFalse(os.path.exists(self.calls), "build-driver.sh ran a module (un)loading command")

    def test_refused_tree_builds_nothing(self):
        root = self.tree("525.147.05", OLD_BITS, 0x10)
        code, out = self.build("--src", root, "--kernel-headers", self.headers)
        self.assertEqual(code, 4, out)
        self.assertIn("nothing built", out)
        self.assertFalse(os.path.exists(os.path.join(root, "make.log")))

    def test_version_mismatch_is_refused_unless_forced(self):
        root = self.tree("580.142", NEW_BITS, 0x10108)
        smi = os.path.join(self.bin, "nvidia-smi")
        write(smi, "#!/bin/sh\necho 580.159.04\n")
        code, out = self.build("--src", root, "--kernel-headers", self.headers)
        self.assertEqual(code, 1, out)
        self.assertIn("source version 580.142 != installed driver 580.159.04", out)
        self.assertFalse(os.path.exists(os.path.join(root, "make.log")))
        code, out = self.build("--src", root, "--kernel-headers", self.headers, "--force")
        self.assertEqual(code, 0, out)

    def test_missing_headers_and_usage(self):
        root = self.tree("580.142", NEW_BITS, 0x10108)
        code, out = self.build("--src", root, "--kernel-headers", os.path.join(self.dir, "nope"))
        self.assertEqual(code, 1, out)
        self.assertIn("no kernel headers", out)
        self.assertEqual(self.build("--src", root, "--sign-key", "k")[0], 2)
        self.assertEqual(self.build()[0], 2)
        self.assertFalse(os.path.exists(os.path.join(root, "make.log")))


if __name__ == "__main__":
    unittest.main()
