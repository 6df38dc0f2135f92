from glm53.cli import main

if __name__ == "__main__":  # a spawned worker (synth --jobs) imports this module too
    raise SystemExit(main())
