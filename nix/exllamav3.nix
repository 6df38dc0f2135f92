# exllamav3, pinned to the version glm53's GPU engine is built and tested on (pyproject's `gpu`
# extra). PyPI ships it as a pure-Python wheel: torch compiles its CUDA extension on first import
# (torch.utils.cpp_extension), so glm53's CUDA package puts nvcc, a host compiler, ninja and the
# CUDA headers on the path of its `glm53` command (nix/package.nix).
{ lib
, buildPythonPackage
, fetchPypi
, torch
, tokenizers
, numpy
, rich
, typing-extensions
, safetensors
, ninja
, pillow
, pyyaml
, marisa-trie
, pydantic
, llguidance
}:

buildPythonPackage rec {
  pname = "exllamav3";
  version = "1.6.5";
  format = "wheel";

  src = fetchPypi {
    inherit pname version;
    format = "wheel";
    dist = "py3";
    python = "py3";
    hash = "sha256-VQwNBMdV8kmEDlwe3Caw6AxzQsM7XZmtF0eau0B+je0=";
  };

  dependencies = [
    torch
    tokenizers
    numpy
    rich
    typing-extensions
    safetensors
    ninja
    pillow
    pyyaml
    marisa-trie
    pydantic
    llguidance
  ];

  # Importing it builds the CUDA extension, which needs a GPU toolchain at run time.
  dontUsePythonImportsCheck = true;

  meta = {
    description = "Inference library for running local LLMs on consumer GPUs (EXL3 format)";
    license = lib.licenses.mit;
    platforms = lib.platforms.linux;
  };
}
