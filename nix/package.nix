# glm53 as a nixpkgs Python package; the flake's overlay adds it to every python3Packages set.
# CPU build by default; with cudaSupport (nixpkgs config) the glm53._cuda library is built by
# nvcc for config.cudaCapabilities, torch is nixpkgs' CUDA build and exllamav3 comes along.
{ lib
, config
, buildPythonPackage
, src
, symlinkJoin
, meson-python
, meson
, ninja
, cython
, pkg-config
, numpy
, msgspec
, granian
, uvloop
, jinja2
, tokenizers
, torch
, httpx
, transformers
, safetensors
, rich
, huggingface-hub
, nvidia-ml-py
, llguidance
, exllamav3
, cudaPackages
, autoAddDriverRunpath
, cudaSupport ? config.cudaSupport
}:

let
  cudaCapabilities = config.cudaCapabilities or [ "8.6" "8.9" "9.0" "12.0" ];
  gpuArchs = lib.concatStringsSep ";" (map (lib.replaceStrings [ "." ] [ "" ]) cudaCapabilities);

  # One tree with nvcc, the runtime (static too: glm53._cuda links cudart_static) and the headers,
  # for meson's CUDA dependency at build time and for exllamav3's extension build at run time.
  cudaRoot = symlinkJoin {
    name = "glm53-cuda-root";
    paths = with cudaPackages; [
      cuda_nvcc
      (lib.getBin cuda_nvcc)
      (lib.getDev cuda_cudart)
      (lib.getLib cuda_cudart)
      (lib.getOutput "static" cuda_cudart)
      cuda_cccl
      (lib.getDev libcublas)
      (lib.getLib libcublas)
      (lib.getDev libcurand)
      (lib.getLib libcurand)
    ];
  };

  # CUDA builds must use the host compiler nvcc supports.
  buildPython = if cudaSupport then buildPythonPackage.override { stdenv = cudaPackages.backendStdenv; } else buildPythonPackage;
in
buildPython {
  pname = "glm53";
  version = "0.1.0"; # meson.build's project version
  pyproject = true;
  inherit src;

  build-system = [ meson-python cython ];
  nativeBuildInputs = [ meson ninja pkg-config ]
    ++ lib.optionals cudaSupport [ cudaPackages.cuda_nvcc autoAddDriverRunpath ];
  buildInputs = lib.optionals cudaSupport [ cudaRoot ];

  # The meson-python hook passes each entry as -Csetup-args=...
  mesonFlags = [
    (lib.mesonEnable "cuda" cudaSupport)
    (lib.mesonOption "gpu_archs" gpuArchs)
  ];
  env = lib.optionalAttrs cudaSupport { CUDA_PATH = "${cudaRoot}"; };

  dependencies = [
    numpy
    msgspec
    granian
    uvloop
    jinja2
    tokenizers
    torch
    httpx
    transformers
    safetensors
    rich
    huggingface-hub
    nvidia-ml-py
    llguidance
  ] ++ lib.optionals cudaSupport [ exllamav3 ];

  # exllamav3 compiles its CUDA extension on first use: give `glm53` the toolchain for it.
  makeWrapperArgs = lib.optionals cudaSupport [
    "--set-default" "CUDA_HOME" "${cudaRoot}"
    "--set-default" "TORCH_CUDA_ARCH_LIST" (lib.concatStringsSep ";" cudaCapabilities)
    "--prefix" "PATH" ":" (lib.makeBinPath [ cudaRoot ninja cudaPackages.backendStdenv.cc ])
  ];

  # pyproject pins the CPU engine's reference stack exactly (its numbers were checked under those
  # versions); nixpkgs carries its own releases of them, so the runtime check takes nixpkgs'.
  # The CPU engine's numbers are then unchecked: tests/test_reference_stack.py names the difference.
  pythonRelaxDeps = [ "transformers" "tokenizers" "huggingface-hub" ];

  # The test suite starts servers and takes minutes; it runs in the project's CI. The package
  # build checks that every native module imports.
  doCheck = false;
  pythonImportsCheck = [ "glm53" "glm53._clock" "glm53._odirect" "glm53._gemv" "glm53._handoff"
    "glm53._sample" "glm53._lane" "glm53.notify" ]
    ++ lib.optionals cudaSupport [ "glm53._cuda" ];

  meta = {
    description = "Serve GLM-5.3-Flash from one small NVIDIA GPU behind an OpenAI-compatible API";
    license = lib.licenses.asl20;
    mainProgram = "glm53";
    platforms = lib.platforms.linux;
  };
}
