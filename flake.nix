{
  description = "glm53: GLM-5.3-Flash on one small NVIDIA GPU behind an OpenAI-compatible API";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      lib = nixpkgs.lib;
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: lib.genAttrs systems f;

      # The compute capabilities glm53's CUDA library is built for (meson option gpu_archs).
      cudaCapabilities = [ "8.6" "8.9" "9.0" "12.0" ];

      # One nixpkgs instance per flavour, as nixpkgs' own CUDA packages expect: the CUDA one
      # sets cudaSupport globally so torch is a CUDA build too. CUDA is unfree; only the CUDA
      # instance accepts it.
      pkgsFor = system: cudaSupport: import nixpkgs {
        inherit system;
        overlays = [ self.overlays.default ];
        config = {
          inherit cudaSupport cudaCapabilities;
          allowUnfree = cudaSupport;
        };
      };

      # `nix run` starts the server: `glm53 serve` with any further arguments.
      serveApp = pkgs: glm53: {
        type = "app";
        program = lib.getExe (pkgs.writeShellScriptBin "glm53-serve" ''
          exec ${lib.getExe glm53} serve "$@"
        '');
        meta.description = "glm53 serve (the demo checkpoint on the CPU without --model)";
      };
    in
    {
      overlays.default = final: prev: {
        pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
          (pyFinal: pyPrev: {
            exllamav3 = pyFinal.callPackage ./nix/exllamav3.nix { };
            glm53 = pyFinal.callPackage ./nix/package.nix { src = self; };
          })
        ];
      };

      packages = forAllSystems (system: {
        default = (pkgsFor system false).python3Packages.glm53;
        cuda = (pkgsFor system true).python3Packages.glm53;
      });

      apps = forAllSystems (system: {
        default = serveApp (pkgsFor system false) self.packages.${system}.default;
        cuda = serveApp (pkgsFor system true) self.packages.${system}.cuda;
      });

      devShells = forAllSystems (system:
        let
          pkgs = pkgsFor system false;
          glm53 = self.packages.${system}.default;
        in
        {
          # Everything to build and test glm53 in place:
          #   pip install --no-build-isolation -e '.[test]' && python -m pytest -q
          default = pkgs.mkShell {
            inputsFrom = [ glm53 ]; # its build tools and Python dependencies
            packages = [
              (pkgs.python3.withPackages (ps: [
                ps.meson-python ps.cython ps.pip ps.pytest ps.hypothesis ps.openai
              ]))
              pkgs.meson pkgs.ninja pkgs.pkg-config pkgs.ruff
            ];
          };
        });

      nixosModules.default = import ./nix/module.nix self;

      # The CPU build (with its import checks) is what `nix flake check` builds; CUDA needs a GPU
      # builder and the unfree toolkit.
      checks = forAllSystems (system: { inherit (self.packages.${system}) default; });
    };
}
