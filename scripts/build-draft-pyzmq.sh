#!/usr/bin/env bash
# Build a draft-API libzmq (CURVE via libsodium) from Debian's `zeromq3` source
# package, and a pyzmq linked against it, into <repo>/.venv-draft.
#
#   bash scripts/build-draft-pyzmq.sh      # as root on Debian 12 (apt-get is used)
#
# Idempotent: a second run re-verifies the venv (~1 s) and exits 0.
# Last line of output on success:  DRAFT_PYTHON=<repo>/.venv-draft/bin/python
#
# Environment knobs (all optional):
#   PYTHON=python3         interpreter used to create the venv
#   DRAFT_FORCE=1          ignore stamps, rebuild libzmq and the venv
#
# Never create CLIENT/SERVER sockets with the stock PyPI pyzmq: without the draft
# API a CLIENT<->SERVER handshake aborts the process (see shared FACTS.md).
set -euo pipefail

PYZMQ_VERSION=27.3.0
# Bump when build options change: invalidates the stamps below.
BUILD_CONFIG="v3 pyzmq=${PYZMQ_VERSION} drafts=on curve=libsodium"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache/draft-zmq"
SRC_ROOT="$CACHE/src"
BUILD_DIR="$CACHE/build"
PREFIX="$CACHE/prefix"
LOGS="$CACHE/logs"
VENV="$REPO/.venv-draft"
DRAFT_PY="$VENV/bin/python"
VENV_STAMP="$VENV/.zio-draft-stamp"
ZMQ_STAMP="$PREFIX/.zio-draft-stamp"
DEBSRC_FILE=/etc/apt/sources.list.d/zio-spark-deb-src.sources
PYTHON="${PYTHON:-python3}"
FORCE="${DRAFT_FORCE:-0}"

START=$SECONDS
STEP="start"
log()  { printf '[draft-zmq %3ss] %s\n' "$((SECONDS - START))" "$*"; }
die()  { printf '[draft-zmq] ERROR: %s\n' "$*" >&2; exit 1; }
on_err() {
  local rc=$?
  printf '[draft-zmq] ERROR: step "%s" failed (exit %s); logs in %s\n' "$STEP" "$rc" "$LOGS" >&2
  exit "$rc"
}
trap on_err ERR
# run LOGNAME CMD...: run quietly into $LOGS/LOGNAME.log, show its tail on failure.
run() {
  local name=$1; shift
  if ! "$@" >"$LOGS/$name.log" 2>&1; then
    printf '[draft-zmq] ERROR: %s failed; last lines of %s:\n' "$*" "$LOGS/$name.log" >&2
    tail -n 30 "$LOGS/$name.log" >&2
    return 1
  fi
}

mkdir -p "$CACHE" "$LOGS"
# One build at a time (two concurrent runs would trample the same build tree).
exec 9>"$CACHE/.lock"
command -v flock >/dev/null && flock 9

# ---------------------------------------------------------------------------
# Verification: draft+curve, libzmq from our prefix (no LD_LIBRARY_PATH needed),
# a plain and a CURVE CLIENT<->SERVER round trip over tcp on 127.0.0.1.
# ---------------------------------------------------------------------------
# Sets VERIFY_ERR on failure, LDD_LINE and ZMQ_VERSION_SEEN on success.
VERIFY_ERR="" LDD_LINE="" ZMQ_VERSION_SEEN=""
verify() {
  VERIFY_ERR=""
  [[ -x "$DRAFT_PY" ]] || { VERIFY_ERR="no $DRAFT_PY"; return 1; }
  local ext libline
  ext="$(env -u LD_LIBRARY_PATH "$DRAFT_PY" -c \
        'import zmq.backend.cython._zmq as m; print(m.__file__)' 2>"$LOGS/verify.log")" \
    || { VERIFY_ERR="cannot import zmq: $(tail -n1 "$LOGS/verify.log")"; return 1; }
  libline="$(env -u LD_LIBRARY_PATH ldd "$ext" | grep -E 'libzmq\.so' || true)"
  if [[ "$libline" != *"$PREFIX/lib/libzmq.so"* ]]; then
    VERIFY_ERR="pyzmq extension $ext does not load $PREFIX/lib/libzmq.so: '${libline:-no libzmq line}'"
    return 1
  fi
  if [[ "$(ldd "$PREFIX/lib/libzmq.so")" != *libsodium* ]]; then
    VERIFY_ERR="$PREFIX/lib/libzmq.so is not linked against libsodium"
    return 1
  fi
  LDD_LINE="$(echo "$libline" | sed 's/^[[:space:]]*//')"
  ZMQ_VERSION_SEEN="$(env -u LD_LIBRARY_PATH timeout 60 "$DRAFT_PY" - "$PYZMQ_VERSION" 2>"$LOGS/verify.log" <<'EOF'
import sys
import zmq
want_pyzmq = sys.argv[1]
assert zmq.__version__ == want_pyzmq, f"pyzmq {zmq.__version__} != {want_pyzmq}"
assert zmq.has("draft") and zmq.has("curve"), (zmq.has("draft"), zmq.has("curve"))
ctx = zmq.Context()
try:
    def roundtrip(curve: bool) -> None:
        srv = ctx.socket(zmq.SERVER)
        cli = ctx.socket(zmq.CLIENT)
        for s in (srv, cli):
            s.linger = 0
            s.rcvtimeo = 5000
            s.sndtimeo = 5000
        if curve:
            spub, ssec = zmq.curve_keypair()
            cpub, csec = zmq.curve_keypair()
            srv.curve_server = True
            srv.curve_secretkey = ssec
            cli.curve_serverkey = spub
            cli.curve_publickey = cpub
            cli.curve_secretkey = csec
        port = srv.bind_to_random_port("tcp://127.0.0.1")
        cli.connect(f"tcp://127.0.0.1:{port}")
        cli.send(b"ping")
        frame = srv.recv(copy=False)
        assert frame.bytes == b"ping", frame.bytes
        rid = frame.routing_id
        assert rid, "no routing_id on SERVER frame"
        srv.send(b"pong", routing_id=rid)
        assert cli.recv() == b"pong"
        srv.close()
        cli.close()
    roundtrip(curve=False)
    roundtrip(curve=True)
finally:
    ctx.term()
print(zmq.zmq_version())
EOF
)" || { VERIFY_ERR="draft/curve/round-trip check failed: $(tail -n1 "$LOGS/verify.log")"; return 1; }
  "$DRAFT_PY" -c 'import zio_spark' 2>"$LOGS/verify.log" \
    || { VERIFY_ERR="zio_spark is not importable from $DRAFT_PY: $(tail -n1 "$LOGS/verify.log")"; return 1; }
  return 0
}

stamp_value() { printf '%s repo=%s prefix=%s\n' "$BUILD_CONFIG" "$REPO" "$PREFIX"; }

# The project's test extras put pyspark in this venv too: bytecode for its pyspark.zip, as
# scripts/setup.sh does for .venv (idempotent; a check of ~1 s when already done).
precompile_pyspark() {
  STEP="precompile pyspark.zip"
  run precompile "$DRAFT_PY" -m zio_spark.cli.precompile \
    || die "could not precompile the pyspark.zip of $VENV; see $LOGS/precompile.log"
  local line
  while read -r line; do log "$line"; done <"$LOGS/precompile.log"
}

finish() {
  precompile_pyspark
  log "verified: pyzmq $PYZMQ_VERSION, libzmq $ZMQ_VERSION_SEEN, draft+curve, CLIENT<->SERVER ok (plain and CURVE)"
  log "ldd: $LDD_LINE"
  log "total time: $((SECONDS - START)) s"
  echo "DRAFT_PYTHON=$DRAFT_PY"
  exit 0
}

# ---------------------------------------------------------------------------
# Fast path
# ---------------------------------------------------------------------------
STEP="fast-path check"
# The whole project with its test extras (pyspark included) goes into the draft venv too,
# so Spark's source and sink are tested over real CLIENT/SERVER sockets. pip keeps the
# draft pyzmq already there (it satisfies "pyzmq>=26"); verify() checks it afterwards.
# Own stamp: a pyproject.toml change reinstalls the project, never rebuilds libzmq.
PROJECT_STAMP="$VENV/.zio-project-stamp"
project_stamp() { sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1; }
install_project() {
  if [[ -f "$PROJECT_STAMP" && "$(cat "$PROJECT_STAMP")" == "$(project_stamp)" ]]; then
    return 0
  fi
  STEP="pip install -e .[test] (project)"
  log "pip install -e $REPO[test] into $VENV (keeps the draft pyzmq)"
  run pip-project "$DRAFT_PY" -m pip install -q --disable-pip-version-check \
    -e "$REPO[test]" --config-settings editable_mode=compat \
    || die "pip install -e $REPO[test] failed; see $LOGS/pip-project.log"
  verify || die "after installing the project: $VERIFY_ERR (did pip replace the draft pyzmq?)"
  project_stamp >"$PROJECT_STAMP"
}

if [[ "$FORCE" != 1 && -f "$VENV_STAMP" && "$(cat "$VENV_STAMP")" == "$(stamp_value)" ]]; then
  if verify; then
    log "already built: $VENV (stamp ok)"
    install_project
    finish
  fi
  log "stamp present but verification failed ($VERIFY_ERR): rebuilding"
fi

# ---------------------------------------------------------------------------
# 1. System packages (apt), deb-src entries
# ---------------------------------------------------------------------------
STEP="prerequisites"
command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found (set PYTHON=/path/to/python3.11)"
PY_EXE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10)' \
  || die "$PY_EXE is older than Python 3.10"

NEED_PKGS=()
for p in dpkg-dev cmake g++ make libsodium-dev pkg-config; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" == *"install ok installed"* ]] \
    || NEED_PKGS+=("$p")
done
# Debian's own python needs python3-venv (ensurepip) and python3-dev (headers).
PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
  [[ "$PY_EXE" == /usr/bin/* ]] || die "$PY_EXE lacks ensurepip/venv and is not Debian's python"
  NEED_PKGS+=(python3-venv)
fi
if [[ ! -f "$PY_INCLUDE/Python.h" ]]; then
  [[ "$PY_EXE" == /usr/bin/* ]] || die "$PY_EXE has no headers ($PY_INCLUDE/Python.h missing)"
  NEED_PKGS+=(python3-dev)
fi

have_src_tree() { compgen -G "$SRC_ROOT/zeromq3-*/CMakeLists.txt" >/dev/null; }
NEED_SOURCE=1
if [[ "$FORCE" != 1 ]] && have_src_tree; then NEED_SOURCE=0; fi
if [[ "$FORCE" != 1 && -f "$ZMQ_STAMP" && "$(cat "$ZMQ_STAMP")" == "$(stamp_value)" ]]; then
  NEED_SOURCE=0   # libzmq already installed in the prefix: source not needed
fi

APT_UPDATED=0
apt_update_once() {
  [[ $APT_UPDATED == 1 ]] && return 0
  log "apt-get update"
  if ! apt-get update -q >"$LOGS/apt-update.log" 2>&1; then
    if grep -qi 'malformed' "$LOGS/apt-update.log"; then
      tail -n 20 "$LOGS/apt-update.log" >&2
      [[ -f "$DEBSRC_FILE" ]] && rm -f "$DEBSRC_FILE" && echo "removed $DEBSRC_FILE" >&2
      die "apt sources are malformed"
    fi
    log "warning: apt-get update reported errors (some repositories unreachable?); continuing. See $LOGS/apt-update.log"
  fi
  APT_UPDATED=1
}

need_root() {
  [[ $EUID -eq 0 ]] || die "must run as root to $1 (or do it by hand first)"
  command -v apt-get >/dev/null || die "apt-get not found: this script targets Debian 12"
}

# Is any deb-src configured (enabled)? Looks at one-line and deb822 sources.
debsrc_configured() {
  "$PYTHON" - <<'EOF'
import glob, re, sys
found = False
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        for line in open(path):
            if re.match(r"\s*deb-src\s", line):
                found = True
    except OSError:
        pass
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        text = open(path).read()
    except OSError:
        continue
    for stanza in re.split(r"\n\s*\n", text):
        fields = {}
        for line in stanza.splitlines():
            m = re.match(r"([A-Za-z-]+):\s*(.*)", line)
            if m and not line.startswith("#"):
                fields[m.group(1).lower()] = m.group(2).strip()
        if "deb-src" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
            found = True
sys.exit(0 if found else 1)
EOF
}

# Write $DEBSRC_FILE: a deb-src copy of every enabled Debian 'deb' entry whose suite
# is this release (codename or codename-*). Existing files are left untouched.
write_debsrc() {
  "$PYTHON" - "$DEBSRC_FILE" <<'EOF'
import glob, re, sys
out_path = sys.argv[1]
codename = ""
for line in open("/etc/os-release"):
    if line.startswith("VERSION_CODENAME="):
        codename = line.split("=", 1)[1].strip().strip('"')
if not codename:
    sys.exit("no VERSION_CODENAME in /etc/os-release")
def ours(suite):
    return suite == codename or suite.startswith(codename + "-")
stanzas = []
# one-line format
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line.split("#", 1)[0])
        if not m or not ours(m.group(3)):
            continue
        st = [("Types", "deb-src"), ("URIs", m.group(2)), ("Suites", m.group(3)),
              ("Components", m.group(4).strip())]
        for opt in re.findall(r"([\w-]+)=(\S+)", (m.group(1) or "").strip("[] ")):
            if opt[0].lower() == "signed-by":
                st.append(("Signed-By", opt[1]))
        stanzas.append(["%s: %s" % kv for kv in st])
# deb822 format
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    if path == out_path:
        continue
    try:
        text = open(path).read()
    except OSError:
        continue
    for raw in re.split(r"\n\s*\n", text):
        lines = [l for l in raw.splitlines() if not l.startswith("#")]
        # group fields with their continuation lines
        fields = []
        for l in lines:
            if l[:1] in (" ", "\t") and fields:
                fields[-1][1].append(l)
            else:
                m = re.match(r"([A-Za-z-]+):\s*(.*)", l)
                if m:
                    fields.append((m.group(1), [m.group(2)]))
        d = {k.lower(): v for k, v in fields}
        if "deb" not in " ".join(d.get("types", [""])).split():
            continue
        if " ".join(d.get("enabled", ["yes"])).strip().lower() == "no":
            continue
        suites = [s for s in " ".join(d.get("suites", [""])).split() if ours(s)]
        if not suites:
            continue
        st = ["Types: deb-src"]
        for k, v in fields:
            kl = k.lower()
            if kl == "types":
                continue
            if kl == "suites":
                st.append("Suites: " + " ".join(suites))
                continue
            st.append(f"{k}: {v[0]}".rstrip())
            st.extend(v[1:])
        stanzas.append(st)
if not stanzas:
    sys.exit(f"no enabled 'deb' entry for {codename} found in /etc/apt/sources*")
with open(out_path, "w") as f:
    f.write("# Added by zio-spark scripts/build-draft-pyzmq.sh: source packages for\n"
            "# `apt-get source zeromq3`. Derived from this machine's 'deb' entries.\n")
    f.write("\n\n".join("\n".join(s) for s in stanzas) + "\n")
print(f"{len(stanzas)} deb-src stanza(s)")
EOF
}

have_showsrc() { [[ "$(apt-cache showsrc zeromq3 2>/dev/null || true)" == *"Package: zeromq3"* ]]; }

# deb-src first, so that a single `apt-get update` serves both install and source.
if [[ $NEED_SOURCE == 1 ]]; then
  STEP="deb-src sources"
  if ! debsrc_configured; then
    need_root "add deb-src entries ($DEBSRC_FILE)"
    log "no deb-src configured: writing $DEBSRC_FILE ($(write_debsrc))"
  fi
fi
if ((${#NEED_PKGS[@]})) || { [[ $NEED_SOURCE == 1 ]] && ! have_showsrc; }; then
  STEP="apt-get update"
  need_root "run apt-get update"
  apt_update_once
fi
if ((${#NEED_PKGS[@]})); then
  STEP="apt-get install ${NEED_PKGS[*]}"
  log "apt-get install ${NEED_PKGS[*]}"
  run apt-install env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${NEED_PKGS[@]}" \
    || die "could not install: ${NEED_PKGS[*]}"
fi

if [[ $NEED_SOURCE == 1 ]]; then
  have_showsrc \
    || die "apt knows no source package zeromq3 (check deb-src entries in /etc/apt/sources.list.d/; $LOGS/apt-update.log)"

  # -------------------------------------------------------------------------
  # 2. Debian source package
  # -------------------------------------------------------------------------
  STEP="apt-get source zeromq3"
  rm -rf "$SRC_ROOT"
  mkdir -p "$SRC_ROOT"
  log "apt-get source zeromq3"
  (cd "$SRC_ROOT" && run apt-source apt-get source -q zeromq3)
  have_src_tree || die "apt-get source zeromq3 produced no zeromq3-*/CMakeLists.txt in $SRC_ROOT"
fi

# ---------------------------------------------------------------------------
# 3. libzmq with drafts + CURVE (libsodium), installed into $PREFIX
# ---------------------------------------------------------------------------
if [[ "$FORCE" == 1 || ! -f "$ZMQ_STAMP" || "$(cat "$ZMQ_STAMP")" != "$(stamp_value)" \
      || ! -e "$PREFIX/lib/libzmq.so" ]]; then
  STEP="libzmq build"
  SRC_DIR="$(compgen -G "$SRC_ROOT/zeromq3-*/CMakeLists.txt" | head -n1 | xargs dirname)"
  log "cmake libzmq from $(basename "$SRC_DIR") (drafts, curve/libsodium) -> $PREFIX"
  rm -rf "$BUILD_DIR" "$PREFIX"
  run cmake-configure cmake -S "$SRC_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" \
    -DCMAKE_INSTALL_LIBDIR=lib \
    -DENABLE_DRAFTS=ON \
    -DENABLE_CURVE=ON \
    -DWITH_LIBSODIUM=ON \
    -DBUILD_TESTS=OFF \
    -DWITH_TLS=OFF \
    -DWITH_NSS=OFF \
    -DWITH_LIBBSD=OFF \
    -DBUILD_SHARED=ON \
    -DBUILD_STATIC=OFF \
    -DWITH_DOCS=OFF \
    -DWITH_PERF_TOOL=OFF \
    -DENABLE_CPACK=OFF
  grep -i 'sodium' "$LOGS/cmake-configure.log" >/dev/null \
    || die "cmake did not find libsodium (is libsodium-dev installed?) see $LOGS/cmake-configure.log"
  run cmake-build cmake --build "$BUILD_DIR" --parallel "$(nproc)"
  run cmake-install cmake --install "$BUILD_DIR"
  [[ -e "$PREFIX/lib/libzmq.so" ]] || die "no $PREFIX/lib/libzmq.so after install"
  [[ "$(ldd "$PREFIX/lib/libzmq.so")" == *libsodium* ]] \
    || die "$PREFIX/lib/libzmq.so is not linked against libsodium"
  stamp_value >"$ZMQ_STAMP"
  rm -f "$VENV_STAMP"   # new libzmq: the venv's pyzmq must be rebuilt
else
  log "libzmq already in $PREFIX (stamp ok)"
fi

# ---------------------------------------------------------------------------
# 4. .venv-draft with pyzmq built against $PREFIX (rpath baked in)
# ---------------------------------------------------------------------------
STEP="venv"
log "creating $VENV with $PY_EXE"
rm -f "$VENV_STAMP"
run venv "$PYTHON" -m venv --clear "$VENV"

STEP="pip install pyzmq (source build)"
log "pip install pyzmq==$PYZMQ_VERSION from source (ZMQ_DRAFT_API=1, ZMQ_PREFIX=$PREFIX)"
run pip-pyzmq env -u PIP_REQUIRE_VIRTUALENV \
  ZMQ_DRAFT_API=1 \
  ZMQ_PREFIX="$PREFIX" \
  LDFLAGS="-Wl,-rpath,$PREFIX/lib ${LDFLAGS:-}" \
  PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
  "$DRAFT_PY" -m pip install -q --no-cache-dir --disable-pip-version-check \
    --no-binary pyzmq "pyzmq==$PYZMQ_VERSION"

rm -f "$PROJECT_STAMP"
install_project

# ---------------------------------------------------------------------------
# 5. Verify, stamp
# ---------------------------------------------------------------------------
STEP="verification"
log "verifying (no LD_LIBRARY_PATH)"
verify || die "verification failed: $VERIFY_ERR"
stamp_value >"$VENV_STAMP"
finish
