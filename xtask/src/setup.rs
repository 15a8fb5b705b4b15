//! Installs what the build and the tests need and a fresh machine lacks:
//! `protoc` (for the `pulsar` crate's build script), `openssl` (for a
//! test's key pair) and a Python virtualenv with the official Pulsar Python
//! client (interop tests) and the Python pulsar-dispatcher (benchmark peer).

use std::path::PathBuf;
use std::process::Command;

use crate::{info, run_checked, Paths};

/// Python packages of the test virtualenv, pinned.
pub const PYTHON_PACKAGES: &[(&str, &str)] =
    &[("pulsar-client", "3.13.0"), ("pulsar-dispatcher", "0.1.0")];

/// Whether `program` can be run (it is found; `openssl` answers
/// `--version` with an error, so the exit status says nothing).
fn on_path(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Installs Debian's protobuf-compiler when `protoc` is neither on PATH nor
/// named by `PROTOC`.
pub fn ensure_protoc() -> Result<(), String> {
    if let Ok(p) = std::env::var("PROTOC") {
        if !p.is_empty() && on_path(&p) {
            return Ok(());
        }
    }
    ensure_tool("protoc", "protobuf-compiler", "or point PROTOC at one")
}

/// Installs Debian's openssl when `openssl` is not on PATH: a test makes
/// the RSA key pair of an encrypted message with it.
pub fn ensure_openssl() -> Result<(), String> {
    ensure_tool("openssl", "openssl", "")
}

/// Installs Debian's valgrind when `valgrind` is not on PATH: the bench
/// counts instructions per message with callgrind.
pub fn ensure_valgrind() -> Result<(), String> {
    ensure_tool("valgrind", "valgrind", "")
}

/// Installs the Debian package `package` with apt-get when `tool` is not on
/// PATH (as root only; otherwise fails saying what to install).
fn ensure_tool(tool: &str, package: &str, otherwise: &str) -> Result<(), String> {
    if on_path(tool) {
        return Ok(());
    }
    let how = format!("install {tool} (Debian/Ubuntu: apt-get install -y {package}) {otherwise}");
    if !is_root() || !on_path("apt-get") {
        return Err(format!(
            "`{tool}` is not on PATH and xtask can install it only as root with apt-get: {how}"
        ));
    }
    info(&format!("{tool} is missing; installing Debian's {package}"));
    let noninteractive = |cmd: &mut Command| {
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
    };
    let mut update = Command::new("apt-get");
    update.args(["update", "-q"]);
    noninteractive(&mut update);
    run_checked(&mut update)?;
    let mut install = Command::new("apt-get");
    install.args(["install", "-y", "-q", "--no-install-recommends", package]);
    noninteractive(&mut install);
    run_checked(&mut install)?;
    if !on_path(tool) {
        return Err(format!("{tool} still not on PATH after apt-get: {how}"));
    }
    Ok(())
}

/// Whether `python` exists and runs pip.
fn has_pip(python: &std::path::Path) -> bool {
    python.exists()
        && Command::new(python)
            .args(["-m", "pip", "--version"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
}

/// Creates `target/pyenv` and installs [`PYTHON_PACKAGES`] into it unless
/// they are already there; returns the path of its `python`.
pub fn ensure_python_env(paths: &Paths) -> Result<PathBuf, String> {
    let venv = paths.target.join("pyenv");
    let python = venv.join("bin/python");
    if python.exists() && packages_present(&python) {
        return Ok(python);
    }
    let base = ["python3", "python"]
        .into_iter()
        .find(|p| on_path(p))
        .ok_or("Python 3 is needed for the interop tests and is not on PATH (python3)")?;
    if !has_pip(&python) {
        // A venv without pip (an interrupted creation, or one that failed
        // in ensurepip for want of python3-venv) is made again, or every
        // later run would fail on it.
        if venv.exists() {
            std::fs::remove_dir_all(&venv)
                .map_err(|e| format!("removing the broken virtualenv {}: {e}", venv.display()))?;
        }
        info(&format!(
            "creating the Python virtualenv {}",
            venv.display()
        ));
        run_checked(Command::new(base).args(["-m", "venv"]).arg(&venv)).map_err(|e| {
            format!(
                "{e}\n(on Debian/Ubuntu the venv module comes with `apt-get install python3-venv`)"
            )
        })?;
    }
    let specs: Vec<String> = PYTHON_PACKAGES
        .iter()
        .map(|(name, version)| format!("{name}=={version}"))
        .collect();
    info(&format!(
        "installing {} into {}",
        specs.join(" "),
        venv.display()
    ));
    run_checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(&specs),
    )?;
    if !packages_present(&python) {
        return Err(format!(
            "{} still lacks {} after pip install",
            venv.display(),
            specs.join(" ")
        ));
    }
    Ok(python)
}

fn packages_present(python: &std::path::Path) -> bool {
    let checks: Vec<String> = PYTHON_PACKAGES
        .iter()
        .map(|(name, version)| format!("m.version({name:?}) == {version:?}"))
        .collect();
    let script = format!(
        "import importlib.metadata as m, sys\n\
         try:\n    ok = {}\nexcept m.PackageNotFoundError:\n    ok = False\n\
         import pulsar\nsys.exit(0 if ok else 1)\n",
        checks.join(" and ")
    );
    Command::new(python)
        .args(["-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}
