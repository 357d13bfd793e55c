from disagg_bench.vllm_sim.sim import main

if __name__ == "__main__":
    main()
